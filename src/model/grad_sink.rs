//! Weight gradients summed in one buffer per weight, in place, outside candle's gradient
//! store.
//!
//! candle's backward hands an op's weight gradient back as a new tensor and adds it to the
//! weight's running sum as another new tensor (`zeros_like`, then `add`); an embedding lookup's
//! backward does the same through `index_add`; and a trainer summing micro-batches holds its
//! sum beside each backward's fresh gradients. For a `[vocab, hidden]` matrix that was five
//! vocabulary-sized blocks alive at once (544 MB each at Qwen2.5-0.5B's tied 151,936 × 896 in
//! f32), and for the layers' weights two whole sets of their gradients (1.4 GB each at that
//! size) after every micro-batch's backward but the first.
//!
//! Inside a [`GradSinks`] scope (the trainer opens one over the weights it trains, for a
//! mini-batch's micro-batches) each armed weight has one accumulator, which the backward
//! passes of the ops that compute weight gradients themselves write into across the scope:
//! the fused LM head (`lm_head`, block by block), the embedding lookup ([`lookup`], row by
//! row) and the hand-written decoder layer (`recompute`, whose fresh gradient becomes the sum
//! on the first pass and is added to it after). candle's store receives no gradient for the
//! weight from them; [`GradSinks::take`] hands the sum over as a tensor. An op arms itself
//! when its forward runs inside a scope, and a backward run after the scope closed hands its
//! gradients to candle as before. Only CPU weights in f32 or f64 are armed; every other op,
//! device and type (and any backward outside a scope) runs candle's own path.

use std::cell::RefCell;
use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};

use candle_core::backprop::GradStore;
use candle_core::{CpuStorage, CustomOp1, DType, Layout, Result, Shape, Tensor, TensorId};

use crate::kernels::elem::Elem;
use crate::kernels::storage::add_in_place;

thread_local! {
    /// The weights armed on this thread, by tensor id (a forward consults it when it builds
    /// its ops; the ops keep their sink).
    static ARMED: RefCell<HashMap<TensorId, Arc<Sink>>> = RefCell::new(HashMap::new());
}

/// One weight's gradient summed so far (`None` before the first backward writes to it).
pub(super) struct Sink {
    /// The weight's shape.
    shape: Shape,
    dtype: DType,
    sum: Mutex<Option<CpuStorage>>,
    /// False once the scope has closed: a backward pass run after it (of a graph built
    /// inside it) hands its gradient to candle instead, so that none is lost.
    open: AtomicBool,
}

impl Sink {
    /// Replaces the sum by `f(sum)` (`None` before the first gradient), read and written as a
    /// vector of `T` (moved out of and back into the storage, no copy).
    fn update<T: Elem>(&self, f: impl FnOnce(Option<Vec<T>>) -> Vec<T>) -> Result<()> {
        if T::DTYPE != self.dtype {
            candle_core::bail!(
                "gradient sink: a {:?} gradient for a {:?} weight",
                T::DTYPE,
                self.dtype
            );
        }
        let mut slot = self.sum.lock().unwrap_or_else(|e| e.into_inner());
        let sum = slot.take().map(T::cpu_storage_data).transpose()?;
        *slot = Some(T::to_cpu_storage_owned(f(sum)));
        Ok(())
    }

    /// Runs `f` on the sum as a slice of `T`, with `true` when it already held a gradient
    /// (`f` adds into it) and `false` when it was just made (zeros; `f` may overwrite it).
    pub(super) fn with<T: Elem>(&self, f: impl FnOnce(&mut [T], bool)) -> Result<()> {
        self.update::<T>(|sum| {
            let held = sum.is_some();
            let mut sum = sum.unwrap_or_else(|| vec![T::zero(); self.shape.elem_count()]);
            f(&mut sum, held);
            sum
        })
    }

    /// Adds a whole gradient `g` (the weight's shape, row-major): the first one becomes the
    /// sum as it is (no copy), later ones add into it.
    pub(super) fn add<T: Elem>(&self, g: Vec<T>) -> Result<()> {
        if g.len() != self.shape.elem_count() {
            candle_core::bail!(
                "gradient sink: {} values for a weight of shape {:?}",
                g.len(),
                self.shape
            );
        }
        self.update::<T>(|sum| match sum {
            None => g,
            Some(mut sum) => {
                crate::kernels::simd::par_zip(&mut sum, &g, |a, b| a + b);
                sum
            }
        })
    }

    /// [`Sink::add`] of a CPU tensor's values (copied out: a tensor's storage cannot be taken).
    pub(super) fn add_tensor(&self, g: &Tensor) -> Result<()> {
        let g = g.flatten_all()?;
        match g.dtype() {
            DType::F64 => self.add(g.to_vec1::<f64>()?),
            _ => self.add(g.to_vec1::<f32>()?),
        }
    }

    /// The weight's `[rows, columns]`: its first dimension and the product of the others.
    pub(super) fn dims(&self) -> (usize, usize) {
        let d = self.shape.dims();
        let rows = d.first().copied().unwrap_or(1);
        (rows, self.shape.elem_count() / rows.max(1))
    }

    fn is_open(&self) -> bool {
        self.open.load(Ordering::Acquire)
    }
}

/// The sink an op kept from its forward while its scope is still open; `None` otherwise (the
/// op hands candle the gradient: a backward run after the scope closed loses nothing).
pub(super) fn open(sink: &Option<Arc<Sink>>) -> Option<&Sink> {
    sink.as_deref().filter(|s| s.is_open())
}

/// The sink of `weight` when a scope on this thread armed it, else `None` (the op runs candle's
/// own backward).
pub(super) fn sink_of(weight: &Tensor) -> Option<Arc<Sink>> {
    ARMED.with(|a| a.borrow().get(&weight.id()).cloned())
}

/// Weights whose gradients backward passes sum in place while this value lives (see the
/// module's notes). Dropping it disarms them; sums not taken are freed.
pub struct GradSinks {
    /// Each armed weight (for its id and the gradient store's key) with its sink.
    sinks: Vec<(Tensor, Arc<Sink>)>,
}

impl GradSinks {
    /// Arms every weight of `weights` that is a trained (`Var`) f32 or f64 tensor on the CPU,
    /// on this thread; the others keep candle's path.
    pub fn open<'a>(weights: impl IntoIterator<Item = &'a Tensor>) -> GradSinks {
        let sinks: Vec<(Tensor, Arc<Sink>)> = weights
            .into_iter()
            .filter(|w| {
                w.is_variable()
                    && w.device().is_cpu()
                    && matches!(w.dtype(), DType::F32 | DType::F64)
            })
            .map(|w| {
                let sink = Sink {
                    shape: w.shape().clone(),
                    dtype: w.dtype(),
                    sum: Mutex::new(None),
                    open: AtomicBool::new(true),
                };
                (w.clone(), Arc::new(sink))
            })
            .collect();
        ARMED.with(|a| {
            let mut a = a.borrow_mut();
            for (w, s) in &sinks {
                a.insert(w.id(), s.clone());
            }
        });
        GradSinks { sinks }
    }

    /// The gradient of `weight` summed over this scope's backward passes so far (the sink is
    /// empty afterwards), or `None` when no op wrote to it.
    pub fn take(&self, weight: &Tensor) -> Result<Option<Tensor>> {
        let Some((_, sink)) = self.sinks.iter().find(|(w, _)| w.id() == weight.id()) else {
            return Ok(None);
        };
        let Some(sum) = sink.sum.lock().unwrap_or_else(|e| e.into_inner()).take() else {
            return Ok(None);
        };
        let shape = sink.shape.clone();
        Ok(Some(match sum {
            CpuStorage::F64(v) => Tensor::from_vec(v, shape, weight.device())?,
            CpuStorage::F32(v) => Tensor::from_vec(v, shape, weight.device())?,
            _ => candle_core::bail!("gradient sink: f32 or f64 sums only"),
        }))
    }
}

impl GradSinks {
    /// Moves every sum taken so far into `grads` as its weight's gradient, adding the part
    /// candle's store computed through other ops where it holds one (into the sum, in place:
    /// the sum is this scope's own).
    pub fn drain_into(&self, grads: &mut GradStore) -> Result<()> {
        for (w, _) in &self.sinks {
            let Some(sunk) = self.take(w)? else { continue };
            let sum = match grads.remove(w) {
                Some(rest) if add_in_place(&sunk, &rest)? => sunk,
                Some(rest) => (sunk + rest)?,
                None => sunk,
            };
            grads.insert(w, sum);
        }
        Ok(())
    }
}

impl Drop for GradSinks {
    fn drop(&mut self) {
        ARMED.with(|a| {
            let mut a = a.borrow_mut();
            for (w, s) in &self.sinks {
                s.open.store(false, Ordering::Release);
                // Only this scope's own entry (a nested scope over the same weight replaced it).
                if a.get(&w.id()).is_some_and(|x| Arc::ptr_eq(x, s)) {
                    a.remove(&w.id());
                }
            }
        });
    }
}

/// The rows `ids` `[n]` of `weight` `[vocab, hidden]`: `[n, hidden]`. Inside a scope that armed
/// `weight`, the backward adds each position's gradient row into the weight's sink (positions
/// in order, as candle's `index_add`) and hands candle none; otherwise candle's
/// `index_select`. An id outside the vocabulary is an error naming it.
pub fn lookup(weight: &Tensor, ids: &Tensor) -> Result<Tensor> {
    let Some(sink) = sink_of(weight) else {
        return weight.embedding(ids);
    };
    let ids: Vec<u32> = ids.to_dtype(DType::U32)?.flatten_all()?.to_vec1()?;
    let vocab = sink.dims().0;
    if let Some(&t) = ids.iter().find(|&&t| t as usize >= vocab) {
        candle_core::bail!("token id {t} outside the vocabulary ({vocab})");
    }
    weight.apply_op1(SunkLookup { ids, sink })
}

/// [`lookup`]'s op inside a scope.
struct SunkLookup {
    ids: Vec<u32>,
    sink: Arc<Sink>,
}

impl SunkLookup {
    fn gather<T: Elem>(&self, w: &[T], hid: usize) -> Vec<T> {
        let mut out = Vec::with_capacity(self.ids.len() * hid);
        for &t in &self.ids {
            out.extend_from_slice(&w[t as usize * hid..][..hid]);
        }
        out
    }

    /// `sum[ids[i]] += grad[i]` for every position `i` in order.
    fn scatter<T: Elem>(&self, grad: &Tensor) -> Result<()> {
        let hid = self.sink.dims().1;
        let grad = grad.contiguous()?;
        let host = crate::kernels::storage::Host::new(&[&grad])?;
        let g: &[T] = host.slice(0)?;
        self.sink.with::<T>(|sum, _| {
            for (&t, row) in self.ids.iter().zip(g.chunks_exact(hid)) {
                for (s, &x) in sum[t as usize * hid..][..hid].iter_mut().zip(row) {
                    *s += x;
                }
            }
        })
    }
}

impl CustomOp1 for SunkLookup {
    fn name(&self) -> &'static str {
        "embedding-lookup-into-sink"
    }

    fn cpu_fwd(&self, s: &CpuStorage, l: &Layout) -> Result<(CpuStorage, Shape)> {
        use crate::kernels::storage::contiguous;
        let (_, hid) = l.shape().dims2()?;
        let out = match s {
            CpuStorage::F32(_) => CpuStorage::F32(self.gather(contiguous(s, l, "embedding")?, hid)),
            CpuStorage::F64(_) => CpuStorage::F64(self.gather(contiguous(s, l, "embedding")?, hid)),
            _ => candle_core::bail!("embedding lookup into a sink: f32 or f64 weights only"),
        };
        Ok((out, Shape::from((self.ids.len(), hid))))
    }

    fn bwd(&self, arg: &Tensor, _res: &Tensor, grad: &Tensor) -> Result<Option<Tensor>> {
        if !self.sink.is_open() {
            let ids = Tensor::from_slice(&self.ids, self.ids.len(), arg.device())?;
            return Ok(Some(arg.zeros_like()?.index_add(&ids, grad, 0)?));
        }
        match grad.dtype() {
            DType::F64 => self.scatter::<f64>(grad)?,
            _ => self.scatter::<f32>(grad)?,
        }
        Ok(None)
    }
}

#[cfg(test)]
mod tests {
    use candle_core::{DType, Device, Tensor, Var};
    use candle_nn::VarMap;

    use super::{lookup, GradSinks};
    use crate::model::{Arch, CausalLm, ModelArgs};

    /// The summed log-probs of one batch of two rows (targets: the ids shifted by one).
    fn loss(m: &CausalLm, rows: [[u32; 5]; 2]) -> Tensor {
        let ids = Tensor::new(&rows, &Device::Cpu).unwrap();
        let pos = Tensor::new(&[[0u32, 1, 2, 3, 4]; 2], &Device::Cpu).unwrap();
        let mask = Tensor::ones((2, 5), DType::U32, &Device::Cpu).unwrap();
        let h = m.forward_hidden(&ids, &pos, &mask, None).unwrap();
        let tgt = rows.map(|r| [r[1], r[2], r[3], r[4], r[0]]);
        let tgt = Tensor::new(&tgt, &Device::Cpu).unwrap();
        let (lp, _) = m.token_logprobs(&h, &tgt, 3, true).unwrap();
        lp.sum_all().unwrap()
    }

    fn values(t: &Tensor) -> Vec<f64> {
        let t = t.to_dtype(DType::F64).unwrap();
        t.flatten_all().unwrap().to_vec1().unwrap()
    }

    /// Every value of `got` within `tol` of the largest of `want` (at least 1).
    fn close(got: &[f64], want: &[f64], tol: f64, what: &str) {
        assert_eq!(got.len(), want.len(), "{what}");
        let (worst, scale) = crate::testing::worst_of(got, want);
        assert!(worst <= tol * scale.max(1.0), "{what}: off by {worst}");
    }

    fn vars(vm: &VarMap) -> Vec<(String, Var)> {
        let mut v: Vec<_> = vm.data().lock().unwrap().clone().into_iter().collect();
        v.sort_by(|a, b| a.0.cmp(&b.0));
        v
    }

    /// Two backward passes inside a scope (a token repeated within and across the batches):
    /// each sunk weight's sink (the vocabulary matrices, every weight of the hand-written
    /// layers) holds the sum of the two gradients candle's own backward gives outside a scope
    /// (f64: 1e-12 of scale; f32: 1e-5), candle's store holds none for it, and the one weight
    /// left to candle (the final norm) has candle's gradient, bit for bit. Tied (Llama) and
    /// untied (Qwen2) output embeddings; layers keeping their activations or recomputing them.
    #[test]
    fn sunk_gradients_equal_candles_own() {
        let batches = [
            [[4u32, 8, 15, 16, 4], [1, 2, 3, 4, 5]],
            [[9, 8, 7, 4, 60], [0, 0, 1, 2, 3]],
        ];
        // (arch, dtype, tolerance, recompute, composed layers)
        for (arch, dtype, tol, recompute, composed) in [
            (Arch::Llama, DType::F64, 1e-12, false, false),
            (Arch::Qwen2, DType::F64, 1e-12, true, false),
            (Arch::Qwen2, DType::F64, 1e-12, true, true),
            (Arch::Qwen3Moe, DType::F64, 1e-12, false, false),
            (Arch::Qwen3_5, DType::F64, 1e-12, false, false),
            (Arch::Llama, DType::F32, 1e-5, false, false),
        ] {
            let mut args = ModelArgs::tiny(arch, 61);
            args.tie_word_embeddings = arch == Arch::Llama;
            let (vm, mut m) = crate::testing::tiny_model(&args, dtype, 0.3);
            let exec = m.exec();
            m.set_exec(crate::model::Exec {
                recompute,
                composed,
                ..exec
            });
            let what = format!("{arch:?} {dtype:?} recompute {recompute} composed {composed}");
            let vars = vars(&vm);
            let grads = |g: &candle_core::backprop::GradStore| -> Vec<Option<Vec<f64>>> {
                vars.iter()
                    .map(|(_, v)| g.get(v.as_tensor()).map(values))
                    .collect()
            };
            // candle's own, outside a scope: each batch's gradients, summed here (none for a
            // weight that took no part, such as an expert no token was routed to).
            let per_batch: Vec<_> = batches
                .iter()
                .map(|b| grads(&loss(&m, *b).backward().unwrap()))
                .collect();
            let want: Vec<Option<Vec<f64>>> = (0..vars.len())
                .map(|i| sum(per_batch.iter().map(|g| g[i].clone())))
                .collect();
            // A graph built inside a scope whose backward runs after it closed: candle gets
            // every gradient (none is left in a sink nobody takes).
            let late = {
                let _s = GradSinks::open(vars.iter().map(|(_, v)| v.as_tensor()));
                loss(&m, batches[0])
            };
            let got = grads(&late.backward().unwrap());
            for (((name, _), g), w) in vars.iter().zip(got).zip(&per_batch[0]) {
                assert_eq!(g.is_some(), w.is_some(), "{what} {name} late");
                if let (Some(g), Some(w)) = (g, w) {
                    close(&g, w, tol, &format!("{what} {name} late"));
                }
            }
            let sinks = GradSinks::open(vars.iter().map(|(_, v)| v.as_tensor()));
            let per_batch: Vec<_> = batches
                .iter()
                .map(|b| grads(&loss(&m, *b).backward().unwrap()))
                .collect();
            let mut sunk = 0;
            for (i, ((name, v), w)) in vars.iter().zip(&want).enumerate() {
                let c = sum(per_batch.iter().map(|g| g[i].clone()));
                match (sinks.take(v.as_tensor()).unwrap(), w) {
                    (Some(s), Some(w)) => {
                        sunk += 1;
                        assert!(c.is_none(), "{what}: candle also has {name}");
                        close(&values(&s), w, tol, &format!("{what} {name}"));
                        assert!(sinks.take(v.as_tensor()).unwrap().is_none(), "taken once");
                    }
                    (Some(_), None) => {
                        panic!("{what}: a sunk gradient for {name}, none in candle's")
                    }
                    (None, w) => assert_eq!(c.as_ref(), w.as_ref(), "{what} {name}"),
                }
            }
            // Everything that has a gradient goes through the embedding lookup, the layer op
            // or the fused head, but the final norm (candle's composition) and Gated DeltaNet
            // layers (their own ops on candle's path, MLP included).
            let layer = |n: &str| n.split('.').take(3).collect::<Vec<_>>().join(".");
            let delta: Vec<String> = vars
                .iter()
                .filter(|(n, _)| n.contains("linear_attn"))
                .map(|(n, _)| layer(n))
                .collect();
            let expected = vars
                .iter()
                .zip(&want)
                .filter(|((n, _), w)| {
                    w.is_some() && n != "model.norm.weight" && !delta.contains(&layer(n))
                })
                .count();
            assert_eq!(sunk, expected, "{what}");
        }
    }

    /// The element-wise sum of the present gradients, `None` when none is.
    fn sum(gs: impl Iterator<Item = Option<Vec<f64>>>) -> Option<Vec<f64>> {
        gs.flatten()
            .reduce(|a, b| a.iter().zip(&b).map(|(x, y)| x + y).collect())
    }

    /// Outside a scope the lookup is candle's (its backward gives candle the gradient); an id
    /// outside the vocabulary is an error naming it inside a scope (as candle's is outside); a
    /// weight with a sunk part and a part in candle's store gets their sum from `drain_into`.
    #[test]
    fn lookup_outside_a_scope_and_bad_ids() {
        let w = Var::new(&[[1f32, 2.], [3., 4.], [5., 6.]], &Device::Cpu).unwrap();
        let ids = Tensor::new(&[2u32, 0, 2], &Device::Cpu).unwrap();
        {
            let _s = GradSinks::open([w.as_tensor()]);
            let x = lookup(w.as_tensor(), &ids).unwrap();
            assert_eq!(values(&x), [5., 6., 1., 2., 5., 6.]);
            let bad = Tensor::new(&[3u32], &Device::Cpu).unwrap();
            let err = lookup(w.as_tensor(), &bad).unwrap_err().to_string();
            assert!(
                err.contains("token id 3 outside the vocabulary (3)"),
                "{err}"
            );
        }
        let x = lookup(w.as_tensor(), &ids).unwrap();
        let g = x.sum_all().unwrap().backward().unwrap();
        // Row 2 looked up twice, row 1 never: counted by hand.
        assert_eq!(
            values(g.get(w.as_tensor()).unwrap()),
            [1., 1., 0., 0., 2., 2.]
        );
        // Reached by the sunk lookup and by another op (Σ w², gradient 2w, in candle's store):
        // `drain_into` adds the two, by hand [1, 1, 0, 0, 2, 2] + [2, 4, 6, 8, 10, 12].
        let s = GradSinks::open([w.as_tensor()]);
        let x = lookup(w.as_tensor(), &ids).unwrap();
        let squares = w.as_tensor().sqr().unwrap().sum_all().unwrap();
        let mut g = (x.sum_all().unwrap() + squares)
            .unwrap()
            .backward()
            .unwrap();
        s.drain_into(&mut g).unwrap();
        assert_eq!(
            values(g.get(w.as_tensor()).unwrap()),
            [3., 5., 6., 8., 12., 14.]
        );
    }
}
