#!/usr/bin/env python3
"""Compiles a kernel module of dataplane/kernels/ with NVRTC the way cuda/compile.rs does
(common.cuh + `#line 1 "<name>.cu"` + the module; --gpu-architecture=sm_90a --std=c++17
--device-as-default-execution-space --include-path=...) to a CUBIN, without a GPU, and
prints the NVRTC log (with --ptxas-options=-v: registers, spills, wgmma serialisation
warnings). Needs libnvrtc (e.g. from the nvidia-cuda-nvrtc wheel). Usage:
  NVRTC_LIB=/path/libnvrtc.so.13 CUDA_INC=/path/include tools/kernel-emu/nvrtc_check.py flash_wg [sm_90a]
"""
import ctypes, os, sys

here = os.path.dirname(os.path.abspath(__file__))
kern = os.path.join(here, "..", "..", "dataplane", "kernels")
name = sys.argv[1] if len(sys.argv) > 1 else "flash_wg"
arch = sys.argv[2] if len(sys.argv) > 2 else "sm_90a"
lib = ctypes.CDLL(os.environ.get("NVRTC_LIB", "libnvrtc.so.13"))
inc = os.environ.get("CUDA_INC", "/usr/local/cuda/include")
common = open(os.path.join(kern, "common.cuh")).read()
text = common + f'\n#line 1 "{name}.cu"\n' + open(os.path.join(kern, name + ".cu")).read()
opts = [f"--gpu-architecture={arch}", "--std=c++17", "--device-as-default-execution-space",
        f"--include-path={inc}", "--ptxas-options=-v"]
if os.path.isdir(os.path.join(inc, "cccl")):
    opts.append(f"--include-path={os.path.join(inc, 'cccl')}")
prog = ctypes.c_void_p()
assert lib.nvrtcCreateProgram(ctypes.byref(prog), text.encode(), f"{name}.cu".encode(), 0, None, None) == 0
arr = (ctypes.c_char_p * len(opts))(*[o.encode() for o in opts])
rc = lib.nvrtcCompileProgram(prog, len(opts), arr)
n = ctypes.c_size_t()
lib.nvrtcGetProgramLogSize(prog, ctypes.byref(n))
log = ctypes.create_string_buffer(n.value)
lib.nvrtcGetProgramLog(prog, log)
print(log.value.decode(errors="replace"))
if rc != 0:
    print(f"NVRTC FAILED (rc {rc})")
    sys.exit(1)
lib.nvrtcGetCUBINSize(prog, ctypes.byref(n))
print(f"ok: {name}.cu → CUBIN of {n.value} bytes for {arch}")
if os.environ.get("PTX_OUT"):
    lib.nvrtcGetPTXSize(prog, ctypes.byref(n))
    buf = ctypes.create_string_buffer(n.value)
    lib.nvrtcGetPTX(prog, buf)
    open(os.environ["PTX_OUT"], "wb").write(buf.value)
if os.environ.get("CUBIN_OUT"):  # for cuobjdump -sass / nvdisasm (e.g. where the spills are)
    lib.nvrtcGetCUBINSize(prog, ctypes.byref(n))
    buf = ctypes.create_string_buffer(n.value)
    lib.nvrtcGetCUBIN(prog, buf)
    open(os.environ["CUBIN_OUT"], "wb").write(buf.raw[: n.value])
