//! Tensor parallelism's two crossings, as ops with their backward (Megatron's `f` and `g`).
//!
//! Inside a tensor-parallel group every rank holds the same activations between layers. A
//! split part of a layer (column-parallel projections, this rank's heads, its vocabulary, its
//! experts) is entered through [`Enter`] and left through [`Leave`]:
//!
//! - [`Enter`] is the identity forward; backward, it sums the group's gradients, since each
//!   rank's split part saw the same input and contributed only its own part of the gradient.
//! - [`Leave`] sums the group's partial outputs forward (a row-parallel projection, the
//!   vocabulary-parallel embedding, the experts' outputs); backward, the identity.
//!
//! Both sum in rank order ([`World::sum_f32`]), so every rank holds the same bits and a layout
//! repeats itself bit for bit. Everything outside the split parts (norms, router, residual
//! stream, losses) is computed the same way on every rank of the group, so the gradients of
//! the parameters every rank holds whole are the same on every rank too.

use std::sync::Arc;

use candle_core::{CpuStorage, CustomOp1, Layout, Result, Shape, Tensor};

use crate::custom_op::contiguous;
use crate::dist::{Group, World};

/// Identity forward; the sum over the tensor-parallel group backward.
#[derive(Clone, Debug)]
pub struct Enter(pub Arc<World>);

/// The sum over the tensor-parallel group forward; identity backward.
#[derive(Clone, Debug)]
pub struct Leave(pub Arc<World>);

fn f32_values<'a>(op: &str, storage: &'a CpuStorage, layout: &Layout) -> Result<&'a [f32]> {
    match storage {
        CpuStorage::F32(values) => contiguous(op, values, layout),
        _ => Err(candle_core::Error::Msg(format!(
            "{op}: tensor parallel runs in f32 only"
        ))),
    }
}

/// The sum of `tensor` over the tensor-parallel group, in rank order.
fn summed(world: &World, tensor: &Tensor) -> Result<Tensor> {
    let values: Vec<f32> = tensor.flatten_all()?.to_vec1()?;
    let sum = world.sum_f32(Group::Tensor, &values);
    Tensor::from_vec(sum, tensor.shape(), tensor.device())
}

impl CustomOp1 for Enter {
    fn name(&self) -> &'static str {
        "tensor-parallel-enter"
    }

    fn cpu_fwd(&self, storage: &CpuStorage, layout: &Layout) -> Result<(CpuStorage, Shape)> {
        let values = f32_values(self.name(), storage, layout)?;
        Ok((CpuStorage::F32(values.to_vec()), layout.shape().clone()))
    }

    fn bwd(&self, _arg: &Tensor, _res: &Tensor, grad: &Tensor) -> Result<Option<Tensor>> {
        summed(&self.0, grad).map(Some)
    }
}

impl CustomOp1 for Leave {
    fn name(&self) -> &'static str {
        "tensor-parallel-leave"
    }

    fn cpu_fwd(&self, storage: &CpuStorage, layout: &Layout) -> Result<(CpuStorage, Shape)> {
        let values = f32_values(self.name(), storage, layout)?;
        let sum = self.0.sum_f32(Group::Tensor, values);
        Ok((CpuStorage::F32(sum), layout.shape().clone()))
    }

    fn bwd(&self, _arg: &Tensor, _res: &Tensor, grad: &Tensor) -> Result<Option<Tensor>> {
        Ok(Some(grad.clone()))
    }
}
