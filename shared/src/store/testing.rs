//! What the store's unit tests share: a run on an in-memory store whose tensors of `FLOATS`
//! floats are one chunk each, and data that delta-encodes well.

use std::sync::Arc;

use bytes::Bytes;
use object_store::ObjectStore;

use super::{DeltaBases, RunStore, ShardInput, Store, StoreOptions, TensorData};
use crate::format::{DType, ShardManifest};
use crate::ids::{RunId, StepKey};

/// Floats per test tensor: one 64 KiB chunk.
pub(crate) const FLOATS: usize = 16 << 10;

/// `FLOATS` floats from `seed`, the first `changed` of them moved by 1.0: two calls with the
/// same seed differ little, which is what a delta wants.
pub(crate) fn floats(seed: u32, changed: usize) -> Bytes {
    let mut values: Vec<f32> = (0..FLOATS)
        .map(|i| ((i as u32).wrapping_mul(2_654_435_761) ^ seed) as f32 / u32::MAX as f32)
        .collect();
    for value in values.iter_mut().take(changed) {
        *value += 1.0;
    }
    Bytes::from(
        values
            .iter()
            .flat_map(|v| v.to_le_bytes())
            .collect::<Vec<u8>>(),
    )
}

/// Run `run` on `objects` (not created), with a local index at `index` if given.
pub(crate) async fn open_run(
    objects: Arc<dyn ObjectStore>,
    run: &str,
    index: Option<&std::path::Path>,
) -> RunStore {
    let options = StoreOptions {
        chunk_bytes: (FLOATS * 4) as u64,
        index_path: index.map(|path| path.to_path_buf()),
        ..StoreOptions::default()
    };
    Store::with_objects(objects, "memory://", options)
        .await
        .expect("an in-memory store opens")
        .run(&run.parse::<RunId>().expect("a valid run id"))
}

/// Rank 0 of 1's shard of `step`: tensor `w` holding `data`.
pub(crate) fn shard(step: u64, data: &Bytes) -> ShardInput {
    ShardInput {
        step: StepKey::new(step, 0),
        rank: 0,
        world_size: 1,
        tensors: vec![TensorData::whole(
            "w",
            DType::F32,
            vec![FLOATS as u64],
            data.clone(),
        )],
        blobs: vec![],
    }
}

/// Writes `data` as step `step`'s shard (not committed), with `bases` offered for deltas.
pub(crate) async fn write(
    run: &RunStore,
    step: u64,
    data: &Bytes,
    bases: Option<&DeltaBases>,
) -> ShardManifest {
    run.write_shard(shard(step, data), bases, &())
        .await
        .expect("the shard is written")
}

/// Delta bases that offer `raw` as the bytes of tensor `w` of `manifest`.
pub(crate) fn bases_of(raw: &Bytes, manifest: &ShardManifest) -> DeltaBases {
    let mut bases = DeltaBases::default();
    bases.insert("w".into(), raw.clone(), manifest.tensors[0].chunks.clone());
    bases
}
