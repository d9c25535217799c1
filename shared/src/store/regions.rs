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
//!
//! A region is [`RegionKind::Stored`] when this rank writes it, or [`RegionKind::Read`] when
//! the rank needs it but another rank stores the same values (a tensor-parallel group holds
//! its norms and router whole on every rank; only its first rank stores them), so that
//! nothing replicated is stored twice. [`row_major_runs`] cuts a rank's contiguous piece of a
//! tensor block (a ZeRO shard of a tensor-parallel split) into the hyper-rectangles of the
//! global tensor that a region names.

use std::ops::Range;
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
    /// Whether this rank stores the region or only reads it.
    #[serde(default)]
    pub kind: RegionKind,
}

/// Whether a rank writes a region into its checkpoint shard or only reads it back.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum RegionKind {
    /// Written by this rank, and read back by it.
    #[default]
    Stored,
    /// Read back by this rank; another rank stores the same values.
    Read,
}

/// The hyper-rectangles that the elements `run` (row-major positions inside a block of
/// `block_shape`, placed at `block_start` of the global tensor) cover, in order, each with
/// the sub-range of `run` it holds. Each rectangle's own row-major order is that sub-range's
/// order, so its bytes are one contiguous run of the rank's flat state. A run inside one
/// row stays one rectangle; a run over whole rows is one; anything else is cut at most twice
/// per dimension.
pub fn row_major_runs(
    block_shape: &[u64],
    block_start: &[u64],
    run: Range<u64>,
) -> Vec<(Vec<DimRange>, Range<u64>)> {
    assert_eq!(
        block_shape.len(),
        block_start.len(),
        "one start per dimension"
    );
    assert!(
        run.end <= block_shape.iter().product::<u64>(),
        "the run lies inside the block"
    );
    let mut out = Vec::new();
    cut(block_shape, run.start, run.end, &mut Vec::new(), &mut out);
    let mut next = run.start;
    out.into_iter()
        .map(|local| {
            let elements: u64 = local.iter().map(|r| r.len).product();
            let slice = local
                .iter()
                .zip(block_start)
                .map(|(r, start)| DimRange {
                    start: r.start + start,
                    len: r.len,
                })
                .collect();
            next += elements;
            (slice, next - elements..next)
        })
        .collect()
}

/// Appends to `out` the rectangles of `[from, to)` in a row-major block of `shape`, each
/// prefixed by `outer` (the single rows of the enclosing dimensions).
fn cut(shape: &[u64], from: u64, to: u64, outer: &mut Vec<DimRange>, out: &mut Vec<Vec<DimRange>>) {
    if from >= to {
        return;
    }
    let Some((rows, rest)) = shape.split_first() else {
        out.push(outer.clone());
        return;
    };
    let inner: u64 = rest.iter().product();
    let (first_row, first_at) = (from / inner, from % inner);
    let (last_row, last_at) = (to / inner, to % inner);
    if first_row == last_row {
        in_row(rest, first_row, first_at..last_at, outer, out);
        return;
    }
    let mut row = first_row;
    if first_at != 0 {
        in_row(rest, first_row, first_at..inner, outer, out);
        row += 1;
    }
    debug_assert!(*rows >= last_row);
    if last_row > row {
        let mut rectangle = outer.clone();
        rectangle.push(DimRange {
            start: row,
            len: last_row - row,
        });
        rectangle.extend(rest.iter().map(|len| DimRange {
            start: 0,
            len: *len,
        }));
        out.push(rectangle);
    }
    if last_at != 0 {
        in_row(rest, last_row, 0..last_at, outer, out);
    }
}

/// [`cut`] of the elements `within` one `row` whose remaining dimensions are `rest`.
fn in_row(
    rest: &[u64],
    row: u64,
    within: Range<u64>,
    outer: &mut Vec<DimRange>,
    out: &mut Vec<Vec<DimRange>>,
) {
    outer.push(DimRange { start: row, len: 1 });
    cut(rest, within.start, within.end, outer, out);
    outer.pop();
}

impl Checkpoint {
    /// Reads every region of `layout` (stored or read-only) from this checkpoint and hands
    /// each to `put` with its bytes (exactly `region.bytes` of them), in layout order. Fails on a tensor the
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
                .filter(|region| region.kind == RegionKind::Stored)
                .map(|region| SourcedTensor {
                    name: region.name.clone(),
                    dtype: region.dtype,
                    global_shape: region.global_shape.clone(),
                    slice: region.slice.clone(),
                    data: region.range(source),
                })
                .collect(),
            blobs,
            copy: None,
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
    /// (`source`) and, per stored region in layout order, the chunks the store recorded for
    /// it (`ShardManifest::tensors`). `None` when the lists do not match the layout.
    pub fn of_regions(
        layout: &[Region],
        source: &Arc<dyn ByteSource>,
        chunks: Vec<Vec<ChunkRef>>,
    ) -> Option<Self> {
        let stored: Vec<&Region> = layout
            .iter()
            .filter(|region| region.kind == RegionKind::Stored)
            .collect();
        if chunks.len() != stored.len() {
            return None;
        }
        let mut bases = Self::default();
        for (region, chunks) in stored.into_iter().zip(chunks) {
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
    use super::{row_major_runs, RestoreChoice};
    use crate::format::DimRange;

    /// Every element of a block, and where each rectangle puts it in the global tensor.
    fn covered(shape: &[u64], start: &[u64], run: std::ops::Range<u64>) -> Vec<Vec<u64>> {
        let mut out = Vec::new();
        for (slice, elements) in row_major_runs(shape, start, run.clone()) {
            let mut index: Vec<u64> = slice.iter().map(|r| r.start).collect();
            for _ in elements {
                out.push(index.clone());
                // Row-major increment inside the rectangle.
                for dim in (0..index.len()).rev() {
                    index[dim] += 1;
                    if index[dim] < slice[dim].start + slice[dim].len {
                        break;
                    }
                    index[dim] = slice[dim].start;
                }
            }
        }
        out
    }

    #[test]
    fn row_major_runs_cover_a_run_in_order_with_few_rectangles() {
        let (shape, start) = ([3u64, 4, 5], [6u64, 0, 10]);
        let total: u64 = shape.iter().product();
        for from in 0..total {
            for to in from..=total {
                let got = covered(&shape, &start, from..to);
                let want: Vec<Vec<u64>> = (from..to)
                    .map(|i| vec![start[0] + i / 20, start[1] + i / 5 % 4, start[2] + i % 5])
                    .collect();
                assert_eq!(got, want, "{from}..{to}");
                assert!(row_major_runs(&shape, &start, from..to).len() <= 5);
            }
        }
        // Whole rows of a column split: one rectangle.
        assert_eq!(
            row_major_runs(&[4, 2], &[0, 2], 2..8),
            vec![(
                vec![DimRange { start: 1, len: 3 }, DimRange { start: 2, len: 2 }],
                2..8
            )]
        );
    }

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
