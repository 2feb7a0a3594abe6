import { defineConfig } from "vite";

// The bundle is embedded in the `hypic` binary under fixed names
// (control/src/ui.rs lists them): one script, one style sheet, no other asset.
export default defineConfig({
  base: "/ui/",
  esbuild: { jsx: "automatic", jsxImportSource: "preact" },
  build: {
    outDir: "dist",
    emptyOutDir: true,
    cssCodeSplit: false,
    assetsInlineLimit: 0,
    modulePreload: { polyfill: false },
    sourcemap: false,
    rollupOptions: {
      output: {
        entryFileNames: "assets/app.js",
        chunkFileNames: "assets/app-[name].js",
        assetFileNames: (a) =>
          a.names?.some((n) => n.endsWith(".css")) ? "assets/app.css" : "assets/[name][extname]",
        inlineDynamicImports: true,
      },
    },
  },
  test: { environment: "node", include: ["src/**/*.test.ts"] },
});
