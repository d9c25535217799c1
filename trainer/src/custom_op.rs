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

/// Overwrites the elements of `tensor`, a contiguous f32 CPU tensor, with `values` (row-major,
/// as many as it holds) in its own storage, on the math pool's threads. Every tensor sharing
/// the storage sees the new values, as with `Var::set`, without its copy of them on the way.
pub(crate) fn set_f32_values(tensor: &candle_core::Tensor, values: &[f32]) -> Result<()> {
    if tensor.elem_count() != values.len() {
        return Err(candle_core::Error::Msg(format!(
            "setting {} values into a tensor of {:?}",
            values.len(),
            tensor.shape()
        )));
    }
    tensor.inplace_op1(&CopyInto(values))
}

/// [`set_f32_values`]'s op.
struct CopyInto<'a>(&'a [f32]);

impl candle_core::InplaceOp1 for CopyInto<'_> {
    fn name(&self) -> &'static str {
        "copy-into"
    }

    fn cpu_fwd(&self, storage: &mut CpuStorage, layout: &Layout) -> Result<()> {
        use rayon::prelude::*;
        let range = layout.contiguous_offsets();
        match (storage, range) {
            (CpuStorage::F32(into), Some((start, end))) => {
                into[start..end]
                    .par_chunks_mut(1 << 16)
                    .zip(self.0.par_chunks(1 << 16))
                    .for_each(|(into, from)| into.copy_from_slice(from));
                Ok(())
            }
            _ => Err(candle_core::Error::Msg(
                "copy-into: the tensor must be a contiguous f32 CPU tensor".into(),
            )),
        }
    }
}

/// Multiplies the elements of `tensor`, a contiguous f32 or f64 CPU tensor, by `factor` in its
/// own storage, on the math pool's threads: the bits of candle's `affine(factor, 0.0)`
/// without its new tensor, for a gradient no one else holds.
pub(crate) fn scale_in_place(tensor: &candle_core::Tensor, factor: f64) -> Result<()> {
    tensor.inplace_op1(&Scale(factor))
}

/// [`scale_in_place`]'s op.
struct Scale(f64);

impl candle_core::InplaceOp1 for Scale {
    fn name(&self) -> &'static str {
        "scale"
    }

    fn cpu_fwd(&self, storage: &mut CpuStorage, layout: &Layout) -> Result<()> {
        use rayon::prelude::*;
        fn scale<T: candle_core::WithDType>(values: &mut [T], factor: f64) {
            // As candle's affine: `v * mul + add` in the tensor's own type.
            let (mul, add) = (T::from_f64(factor), T::from_f64(0.0));
            values
                .par_chunks_mut(1 << 16)
                .for_each(|chunk| chunk.iter_mut().for_each(|v| *v = *v * mul + add));
        }
        match (storage, layout.contiguous_offsets()) {
            (CpuStorage::F32(values), Some((start, end))) => scale(&mut values[start..end], self.0),
            (CpuStorage::F64(values), Some((start, end))) => scale(&mut values[start..end], self.0),
            _ => {
                return Err(candle_core::Error::Msg(
                    "scale: the tensor must be a contiguous f32 or f64 CPU tensor".into(),
                ))
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::{Device, Tensor, Var};

    #[test]
    fn values_are_set_in_the_storage_every_holder_shares() {
        let var = Var::from_tensor(
            &Tensor::zeros((2, 3), candle_core::DType::F32, &Device::Cpu).unwrap(),
        )
        .unwrap();
        let holder = var.as_tensor().clone();
        set_f32_values(&var, &[1.0, 2.0, 3.0, 4.0, 5.0, 6.0]).unwrap();
        assert_eq!(
            holder.to_vec2::<f32>().unwrap(),
            vec![vec![1.0, 2.0, 3.0], vec![4.0, 5.0, 6.0]]
        );
        assert!(set_f32_values(&var, &[1.0]).is_err());
        let f64s = Tensor::zeros(2, candle_core::DType::F64, &Device::Cpu).unwrap();
        assert!(set_f32_values(&f64s, &[1.0, 2.0]).is_err());
    }

    #[test]
    fn scaling_in_place_gives_the_bits_of_an_affine() {
        for dtype in [candle_core::DType::F32, candle_core::DType::F64] {
            let values = (Tensor::arange(-3f32, 3.0, &Device::Cpu).unwrap() * 0.7)
                .unwrap()
                .to_dtype(dtype)
                .unwrap();
            let want: Vec<f64> = values
                .affine(1.0 / 3.0, 0.0)
                .unwrap()
                .to_dtype(candle_core::DType::F64)
                .unwrap()
                .to_vec1()
                .unwrap();
            scale_in_place(&values, 1.0 / 3.0).unwrap();
            let got: Vec<f64> = values
                .to_dtype(candle_core::DType::F64)
                .unwrap()
                .to_vec1()
                .unwrap();
            assert_eq!(
                got.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
                want.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
                "{dtype:?}"
            );
        }
    }
}
