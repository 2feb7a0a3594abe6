//! NCCL between a combiner and a GPU worker process on one host: what travels over
//! the TCP connection of a task (negotiation and headers); the payload bytes move
//! device to device by `ncclSend` / `ncclRecv` (`cuda::nccl`).
//!
//! Negotiation, on the task's connection:
//!
//! 1. the combiner creates an NCCL unique id and sends the task with an
//!    [`NcclOffer`] in [`super::transport::Task::nccl`] (the worker is rank 1 of a
//!    2-rank communicator, the combiner rank 0);
//! 2. the worker answers first with a frame `NCCL_READY` (empty; it then joins the
//!    communicator) or `NCCL_REFUSED` (JSON [`super::transport::Failure`] with the
//!    reason; it then ships that task's entries as wire frames, the TCP payload
//!    path);
//! 3. after `NCCL_READY` both sides create the communicator; per segment the worker
//!    sends a `DEVICE_ENTRY` frame (JSON [`DeviceHeader`]: per entry the model, the
//!    shape, the checksum it computed on its device and the byte length of each
//!    buffer), then each buffer by `ncclSend` in [`DeviceHeader`] order; the
//!    combiner allocates them on its device, receives them by `ncclRecv` and
//!    verifies the checksum on its device, as for the peer transport.
//!
//! A worker that does not know the offer (an older one, or one started without
//! `--nccl`) answers with entries directly; the combiner then reads the task as a
//! plain TCP task.
use serde::{Deserialize, Serialize};

/// Bytes of an NCCL unique id (`ncclUniqueId`).
pub const ID_BYTES: usize = 128;
/// Largest payload one [`DeviceHeader`] may announce (as a wire entry frame).
pub const MAX_PAYLOAD: u64 = 1 << 30;

/// The combiner's offer of an NCCL communicator for one task.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct NcclOffer {
    /// The unique id, 128 bytes as lower-case hex.
    pub id: String,
    /// Ranks of the communicator (2).
    pub world: usize,
    /// The worker's rank (1; the combiner is 0).
    pub rank: usize,
}

impl NcclOffer {
    /// The offer of a communicator with unique id `id`.
    pub fn new(id: &[u8; ID_BYTES]) -> Self {
        NcclOffer {
            id: hex::encode(id),
            world: 2,
            rank: 1,
        }
    }

    /// The unique id's bytes.
    ///
    /// Errors: not 128 bytes of hex, or ranks other than a worker's 1 of 2.
    pub fn id_bytes(&self) -> Result<[u8; ID_BYTES], String> {
        if self.world != 2 || self.rank != 1 {
            return Err(format!(
                "NCCL offer for rank {} of {}; a worker is rank 1 of 2",
                self.rank, self.world
            ));
        }
        let v = hex::decode(&self.id).map_err(|e| format!("NCCL unique id: {e}"))?;
        v.try_into()
            .map_err(|v: Vec<u8>| format!("NCCL unique id of {} bytes, not {ID_BYTES}", v.len()))
    }
}

/// One entry announced by a `DEVICE_ENTRY` frame.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct EntryHeader {
    /// Model fingerprint of the worker (hex).
    pub model: String,
    /// Segment length in tokens.
    pub tokens: usize,
    /// First body token.
    pub body_start: usize,
    /// The entry's checksum ([`super::checksum::entry_checksum`]) computed on the
    /// worker's device.
    pub checksum: u64,
    /// Byte length of each buffer, in the order they are sent (the backend's
    /// buffer order, e.g. `GpuSegmentEntry::buffers`).
    pub buffers: Vec<u64>,
}

/// The body of a `DEVICE_ENTRY` frame: one segment's entries, whose buffers follow
/// by `ncclSend`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct DeviceHeader {
    /// Segment index in the request.
    pub index: usize,
    /// Time the worker spent building it, ms (0 when served from its pool).
    pub prefill_ms: f64,
    /// Served from the worker's pool without a prefill.
    pub resident: bool,
    /// One per body start of the task's segment, in its order.
    pub entries: Vec<EntryHeader>,
}

impl DeviceHeader {
    /// Bytes announced in all.
    pub fn payload_bytes(&self) -> u64 {
        self.entries
            .iter()
            .flat_map(|e| &e.buffers)
            .fold(0u64, |a, &b| a.saturating_add(b))
    }

    /// Parses a `DEVICE_ENTRY` body and checks its bounds.
    ///
    /// Errors: not JSON of this form, no entry, or more than `max` bytes announced.
    pub fn parse(body: &[u8], max: u64) -> Result<Self, String> {
        let h: DeviceHeader =
            serde_json::from_slice(body).map_err(|e| format!("device entry header: {e}"))?;
        if h.entries.is_empty() {
            return Err("device entry header without entries".into());
        }
        let n = h.payload_bytes();
        if n > max {
            return Err(format!("device entry of {n} bytes, the bound is {max}"));
        }
        Ok(h)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parallel_nccl_offer_round_trip_and_refusals() {
        let mut id = [0u8; ID_BYTES];
        for (i, b) in id.iter_mut().enumerate() {
            *b = (i * 7 + 3) as u8;
        }
        let o = NcclOffer::new(&id);
        let j = serde_json::to_string(&o).unwrap();
        let back: NcclOffer = serde_json::from_str(&j).unwrap();
        assert_eq!(back.id_bytes().unwrap(), id);
        let short = NcclOffer {
            id: "00ff".into(),
            ..o.clone()
        };
        assert!(short.id_bytes().unwrap_err().contains("2 bytes"));
        let bad = NcclOffer {
            id: "zz".into(),
            ..o.clone()
        };
        assert!(bad.id_bytes().unwrap_err().contains("hex") || bad.id_bytes().is_err());
        let rank0 = NcclOffer { rank: 0, ..o };
        assert!(rank0.id_bytes().unwrap_err().contains("rank 0 of 2"));
    }

    #[test]
    fn parallel_nccl_header_bounds() {
        let h = DeviceHeader {
            index: 3,
            prefill_ms: 1.5,
            resident: false,
            entries: vec![EntryHeader {
                model: "ab".into(),
                tokens: 40,
                body_start: 8,
                checksum: u64::MAX - 1,
                buffers: vec![16, 0, 4],
            }],
        };
        let b = serde_json::to_vec(&h).unwrap();
        let back = DeviceHeader::parse(&b, 1 << 20).unwrap();
        assert_eq!(back, h);
        assert_eq!(back.entries[0].checksum, u64::MAX - 1, "u64 exact in JSON");
        assert_eq!(back.payload_bytes(), 20);
        assert!(DeviceHeader::parse(&b, 19)
            .unwrap_err()
            .contains("bound is 19"));
        let empty = DeviceHeader {
            entries: vec![],
            ..h
        };
        let e = serde_json::to_vec(&empty).unwrap();
        assert!(DeviceHeader::parse(&e, 1 << 20).is_err());
        assert!(DeviceHeader::parse(b"{", 1 << 20).is_err());
    }
}
