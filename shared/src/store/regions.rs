//! A rank's regions, and the rule for which step a world restores: the decisions about
//! restoring that the trainer and `ckptd` must take the same way, written once.
//!
//! A [`Region`] says where one stored tensor's slice lives in a rank's flat state (the
//! optimizer's buffer, or a `ckptd` shm slot holding a copy of it): at `offset`, `bytes`
//! long. A rank's list of regions is its layout. Writing a checkpoint stores each region
//! as the slice `slice` of the tensor `name`; reading one back asks the checkpoint for the
//! same slices, whatever layout wrote them ([`Checkpoint::read_regions`]); writing builds
//! the shard from the layout over the rank's flat state ([`SourcedShard::from_regions`],
//! with [`DeltaBases::of_regions`] for delta encoding). A new kind of parallelism adds
//! regions, not callers.

use std::sync::Arc;

use bytes::Bytes;
use serde::{Deserialize, Serialize};

use super::{
    ByteSource, Checkpoint, DeltaBases, Progress, SourceRange, SourcedShard, SourcedTensor,
};
use crate::error::StoreError;
use crate::format::{ChunkRef, DType, DimRange};
use crate::{Rank, StepKey};

/// One tensor (or its slice) in a rank's flat state, at a byte offset of it.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Region {
    pub name: String,
    pub dtype: DType,
    pub global_shape: Vec<u64>,
    pub slice: Vec<DimRange>,
    pub offset: u64,
    pub bytes: u64,
}

impl Checkpoint {
    /// Reads every region of `layout` from this checkpoint and hands each to `put` with its
    /// bytes (exactly `region.bytes` of them), in layout order. Fails on a tensor the
    /// checkpoint lacks or stores with another shape.
    pub async fn read_regions<E>(
        &self,
        layout: &[Region],
        progress: &dyn Progress,
        mut put: impl FnMut(&Region, Vec<u8>) -> Result<(), E>,
    ) -> Result<(), E>
    where
        E: From<StoreError>,
    {
        for region in layout {
            let info = self
                .tensor_info(&region.name)
                .ok_or_else(|| StoreError::BadRequest {
                    reason: format!("the checkpoint has no tensor {}", region.name),
                })?;
            if info.global_shape != region.global_shape {
                return Err(StoreError::BadRequest {
                    reason: format!(
                        "checkpoint tensor {} has shape {:?}; this layout stores it as {:?} (was the step written by an older trainer?)",
                        region.name, info.global_shape, region.global_shape
                    ),
                }
                .into());
            }
            let data = self
                .read_region(&region.name, &region.slice, progress)
                .await?;
            if data.len() as u64 != region.bytes {
                return Err(StoreError::BadRequest {
                    reason: format!(
                        "{}: read {} bytes, the layout has {}",
                        region.name,
                        data.len(),
                        region.bytes
                    ),
                }
                .into());
            }
            put(region, data)?;
        }
        Ok(())
    }
}

impl SourcedShard {
    /// What a rank writes for `step`: every region of `layout` as its tensor's slice, its
    /// bytes read from `source` (the rank's flat state: the trainer's optimizer memory, a
    /// `ckptd` slot, or a buddy's replica of one) at the region's offset. Both programs write
    /// through this, with [`RunStore::write_shard_sourced`](super::RunStore::write_shard_sourced).
    pub fn from_regions(
        step: StepKey,
        rank: Rank,
        world_size: u32,
        layout: &[Region],
        source: &Arc<dyn ByteSource>,
        blobs: Vec<(String, Bytes)>,
    ) -> Self {
        Self {
            step,
            rank,
            world_size,
            tensors: layout
                .iter()
                .map(|region| SourcedTensor {
                    name: region.name.clone(),
                    dtype: region.dtype,
                    global_shape: region.global_shape.clone(),
                    slice: region.slice.clone(),
                    data: region.range(source),
                })
                .collect(),
            blobs,
        }
    }
}

impl Region {
    /// This region's bytes in `source`.
    pub fn range(&self, source: &Arc<dyn ByteSource>) -> SourceRange {
        SourceRange {
            source: source.clone(),
            offset: self.offset,
            len: self.bytes,
        }
    }
}

impl DeltaBases {
    /// The delta bases for the next write of `layout`: the previous write's flat state
    /// (`source`) and, per region in layout order, the chunks the store recorded for it
    /// (`ShardManifest::tensors`). `None` when the lists do not match the layout.
    pub fn of_regions(
        layout: &[Region],
        source: &Arc<dyn ByteSource>,
        chunks: Vec<Vec<ChunkRef>>,
    ) -> Option<Self> {
        if chunks.len() != layout.len() {
            return None;
        }
        let mut bases = Self::default();
        for (region, chunks) in layout.iter().zip(chunks) {
            bases.insert(region.name.clone(), region.range(source), chunks);
        }
        Some(bases)
    }
}

/// The step a world restores, from the newest step memory-committed for a world of its
/// size (its ranks' daemons have it in T0 or at a buddy, T1) and the newest durable one
/// (T2). Memory, unless a durable step is newer (durable steps are uploaded from T0, so a
/// newer one means the memory step is stale); else the durable step; else none.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RestoreChoice {
    Memory(u64),
    Durable(u64),
    Fresh,
}

impl RestoreChoice {
    pub fn new(memory: Option<u64>, durable: Option<u64>) -> Self {
        match (memory, durable) {
            (Some(m), Some(d)) if d > m => Self::Durable(d),
            (Some(m), _) => Self::Memory(m),
            (None, Some(d)) => Self::Durable(d),
            (None, None) => Self::Fresh,
        }
    }

    pub fn step(self) -> Option<u64> {
        match self {
            Self::Memory(step) | Self::Durable(step) => Some(step),
            Self::Fresh => None,
        }
    }

    /// The memory-committed step to restore, if memory serves.
    pub fn memory(self) -> Option<u64> {
        match self {
            Self::Memory(step) => Some(step),
            _ => None,
        }
    }

    /// The durable step that storage may serve this choice with: the chosen step itself
    /// when it is durable too (a memory step neither T0 nor T1 can serve any more), never
    /// another step, since every rank of the world must restore the same one.
    pub fn from_storage(self, durable: Option<u64>) -> Option<u64> {
        durable.filter(|d| self.step() == Some(*d))
    }
}

#[cfg(test)]
mod tests {
    use super::RestoreChoice;

    #[test]
    fn memory_serves_unless_a_durable_step_is_newer() {
        assert_eq!(
            RestoreChoice::new(Some(12), Some(10)),
            RestoreChoice::Memory(12)
        );
        assert_eq!(
            RestoreChoice::new(Some(10), Some(10)),
            RestoreChoice::Memory(10)
        );
        assert_eq!(
            RestoreChoice::new(Some(8), Some(10)),
            RestoreChoice::Durable(10)
        );
        assert_eq!(
            RestoreChoice::new(None, Some(10)),
            RestoreChoice::Durable(10)
        );
        assert_eq!(RestoreChoice::new(None, None), RestoreChoice::Fresh);
        assert_eq!(RestoreChoice::new(Some(3), None), RestoreChoice::Memory(3));
    }

    #[test]
    fn storage_serves_only_the_chosen_step() {
        let memory = RestoreChoice::new(Some(12), Some(10));
        assert_eq!(memory.memory(), Some(12));
        assert_eq!(memory.from_storage(Some(10)), None, "another step: never");
        assert_eq!(
            RestoreChoice::new(Some(10), Some(10)).from_storage(Some(10)),
            Some(10)
        );
        assert_eq!(
            RestoreChoice::new(None, Some(10)).from_storage(Some(10)),
            Some(10)
        );
        assert_eq!(RestoreChoice::Fresh.from_storage(None), None);
    }
}
