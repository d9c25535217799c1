//! What the custom ops share: the CPU slices behind candle's storage, with errors that name
//! the op.

use candle_core::{CpuStorage, Layout, Result, Storage};

/// The contiguous elements `layout` selects from `values`.
pub(crate) fn contiguous<'a, T>(op: &str, values: &'a [T], layout: &Layout) -> Result<&'a [T]> {
    let (start, end) = layout
        .contiguous_offsets()
        .ok_or_else(|| candle_core::Error::Msg(format!("{op}: inputs must be contiguous")))?;
    Ok(&values[start..end])
}

/// The CPU storage behind `storage`.
pub(crate) fn cpu<'a>(op: &str, storage: &'a Storage) -> Result<&'a CpuStorage> {
    match storage {
        Storage::Cpu(cpu) => Ok(cpu),
        _ => Err(candle_core::Error::Msg(format!(
            "{op}: runs on the CPU only"
        ))),
    }
}

/// Calls `use_values` with `tensor`'s f32 elements in row-major order, read in place when
/// the tensor is a contiguous f32 CPU tensor, else from a copy.
pub(crate) fn with_f32_values<R>(
    tensor: &candle_core::Tensor,
    use_values: impl FnOnce(&[f32]) -> R,
) -> Result<R> {
    {
        let (storage, layout) = tensor.storage_and_layout();
        if let (Storage::Cpu(CpuStorage::F32(values)), Some((start, end))) =
            (&*storage, layout.contiguous_offsets())
        {
            return Ok(use_values(&values[start..end]));
        }
    }
    let values = tensor.flatten_all()?.to_vec1::<f32>()?;
    Ok(use_values(&values))
}
