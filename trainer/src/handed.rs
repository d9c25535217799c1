//! Parameter gradients that the custom ops hand over themselves, past candle's `GradStore`.
//!
//! candle's backward pass adds every gradient it is given into its store, and for a tensor it
//! has not seen yet it first makes one of zeros to add to: a gradient of N elements costs an
//! allocation of zeros, an addition and a new tensor of N, on one thread while the other
//! waits. For the parameters behind the custom ops, the LM head, the embedding and the
//! experts' stacked weights (97% of the `tiny` model's elements), that was most of what the
//! backward pass did outside the ops themselves. An op wrapped in [`Handed`] instead leaves
//! the gradient of each argument that is a variable in a [`HandedGradients`], and
//! [`HandedGradients::backward`] puts them into the store after candle's pass: the tensor
//! the op made is the tensor the optimizer reads.
//!
//! A gradient handed over is the very tensor the op returned, so the sums are the same bits
//! as through candle's store, but for the sign of a zero (candle's `0.0 + -0.0` is `0.0`),
//! which AdamW's update does not see. Where candle also has a gradient for the same variable
//! (a parameter used outside the op too), the handed one is added after it: the same bits
//! where candle has one such gradient, another order of the same sum where it has more. No
//! parameter of the model is used that way. The embedding's lookup is handed over without
//! tensor parallelism only (`Model::embed_tokens`); the vocabulary-parallel one is candle's.

use std::sync::{Arc, Mutex, MutexGuard};

use candle_core::backprop::GradStore;
use candle_core::{
    CpuStorage, CustomOp1, CustomOp2, CustomOp3, Layout, Result, Shape, Tensor, TensorId,
};

/// Where the ops of one model leave their parameters' gradients during a backward pass.
#[derive(Clone, Debug, Default)]
pub struct HandedGradients(Arc<Mutex<Vec<(TensorId, Tensor)>>>);

impl HandedGradients {
    /// `objective.backward()`, with the gradients handed over during it in the store. A
    /// gradient left from a backward pass that did not come through here is an error: that
    /// pass's parameters went without it.
    pub fn backward(&self, objective: &Tensor) -> Result<GradStore> {
        let left = self.take()?.len();
        if left > 0 {
            return Err(candle_core::Error::Msg(format!(
                "{left} parameter gradient(s) were handed over in a backward pass that did not go through Model::backward, so they were lost"
            )));
        }
        let mut grads = objective.backward()?;
        for (id, grad) in self.take()? {
            let sum = match grads.get_id(id) {
                Some(sum) => sum.add(&grad)?,
                None => grad,
            };
            grads.insert_id(id, sum);
        }
        Ok(grads)
    }

    /// `op`, handing its variables' gradients to these.
    pub fn wrap<Op>(&self, op: Op) -> Handed<Op> {
        Handed {
            op,
            to: self.clone(),
        }
    }

    /// The gradient for `arg`, or none where it was handed over (`arg` is a variable).
    fn hand_over(&self, arg: &Tensor, grad: Option<Tensor>) -> Result<Option<Tensor>> {
        match grad {
            Some(grad) if arg.is_variable() => {
                self.lock()?.push((arg.id(), grad));
                Ok(None)
            }
            grad => Ok(grad),
        }
    }

    /// The gradients handed over since the last call, leaving none.
    fn take(&self) -> Result<Vec<(TensorId, Tensor)>> {
        Ok(std::mem::take(&mut *self.lock()?))
    }

    fn lock(&self) -> Result<MutexGuard<'_, Vec<(TensorId, Tensor)>>> {
        self.0
            .lock()
            .map_err(|_| candle_core::Error::Msg("a previous backward pass panicked".into()))
    }
}

/// A custom op whose variables' gradients go to a [`HandedGradients`] instead of candle's store.
#[derive(Debug)]
pub struct Handed<Op> {
    op: Op,
    to: HandedGradients,
}

impl<Op: CustomOp1> CustomOp1 for Handed<Op> {
    fn name(&self) -> &'static str {
        self.op.name()
    }

    fn cpu_fwd(&self, storage: &CpuStorage, layout: &Layout) -> Result<(CpuStorage, Shape)> {
        self.op.cpu_fwd(storage, layout)
    }

    fn bwd(&self, arg: &Tensor, res: &Tensor, grad_res: &Tensor) -> Result<Option<Tensor>> {
        let grad = self.op.bwd(arg, res, grad_res)?;
        self.to.hand_over(arg, grad)
    }
}

impl<Op: CustomOp2> CustomOp2 for Handed<Op> {
    fn name(&self) -> &'static str {
        self.op.name()
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        self.op.cpu_fwd(s1, l1, s2, l2)
    }

    fn bwd(
        &self,
        arg1: &Tensor,
        arg2: &Tensor,
        res: &Tensor,
        grad_res: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>)> {
        let (grad1, grad2) = self.op.bwd(arg1, arg2, res, grad_res)?;
        Ok((
            self.to.hand_over(arg1, grad1)?,
            self.to.hand_over(arg2, grad2)?,
        ))
    }
}

impl<Op: CustomOp3> CustomOp3 for Handed<Op> {
    fn name(&self) -> &'static str {
        self.op.name()
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
        s3: &CpuStorage,
        l3: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        self.op.cpu_fwd(s1, l1, s2, l2, s3, l3)
    }

    fn bwd(
        &self,
        arg1: &Tensor,
        arg2: &Tensor,
        arg3: &Tensor,
        res: &Tensor,
        grad_res: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        let (grad1, grad2, grad3) = self.op.bwd(arg1, arg2, arg3, res, grad_res)?;
        Ok((
            self.to.hand_over(arg1, grad1)?,
            self.to.hand_over(arg2, grad2)?,
            self.to.hand_over(arg3, grad3)?,
        ))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::experts::{GroupedMatmul, Groups};
    use candle_core::{DType, Device, Var};

    /// A variable used inside a handed op and outside it gets the sum of both gradients, the
    /// same values as through candle's store alone; a tensor that is not a variable keeps
    /// its gradient flowing through candle.
    #[test]
    fn handed_gradients_equal_candles_and_reach_the_store() {
        let device = Device::Cpu;
        let x = Var::from_tensor(
            &Tensor::arange(0f32, 12.0, &device)
                .unwrap()
                .reshape((4, 3))
                .unwrap(),
        )
        .unwrap();
        let w = Var::from_tensor(
            &((Tensor::arange(0f32, 12.0, &device).unwrap() * 0.1)
                .unwrap()
                .reshape((2, 3, 2))
                .unwrap()),
        )
        .unwrap();
        let groups = Groups::from_counts(&[1, 3]);
        let objective = |op_out: Tensor| -> Tensor {
            // `w` outside the op too, and `x` through a non-variable (`x * 2`).
            (op_out.sqr().unwrap().sum_all().unwrap()
                + w.as_tensor().sum_all().unwrap().affine(3.0, 0.0).unwrap())
            .unwrap()
        };
        let doubled = (x.as_tensor() * 2.0).unwrap();
        let plain = objective(
            doubled
                .apply_op2(w.as_tensor(), GroupedMatmul(groups.clone()))
                .unwrap(),
        )
        .backward()
        .unwrap();
        let handed = HandedGradients::default();
        let out = |handed: &HandedGradients| {
            doubled
                .apply_op2(w.as_tensor(), handed.wrap(GroupedMatmul(groups.clone())))
                .unwrap()
        };
        // A backward pass past `backward` loses the handed gradients: the next one says so.
        objective(out(&handed)).backward().unwrap();
        let error = handed.backward(&objective(out(&handed))).unwrap_err();
        assert!(error.to_string().contains("were lost"), "{error}");
        let grads = handed.backward(&objective(out(&handed))).unwrap();
        for var in [&x, &w] {
            let want: Vec<f32> = plain
                .get(var)
                .unwrap()
                .flatten_all()
                .unwrap()
                .to_vec1()
                .unwrap();
            let got: Vec<f32> = grads
                .get(var)
                .unwrap()
                .flatten_all()
                .unwrap()
                .to_vec1()
                .unwrap();
            assert_eq!(got, want);
        }
        assert!(handed.lock().unwrap().is_empty());
        assert_eq!(w.dtype(), DType::F32);
    }
}
