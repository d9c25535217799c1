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
