//! The optimiser side: AdamW per agent (PyTorch's algorithm, written out so that its state can be
//! checkpointed and restored exactly), optional gradient-norm clipping, the skip-on-NaN update, and
//! the shared-parameter round that steps exactly once after all agents.

use std::collections::BTreeMap;

use cotrain_model::kernels::adamw_f32::{AdamWStep, adamw_f32, sum_of_squares_f64};
use tch::{Kind, Tensor, nn};

/// AdamW hyper-parameters (PyTorch defaults for betas and eps; weight decay 0 as in the original).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct AdamWConfig {
    pub lr: f64,
    pub beta1: f64,
    pub beta2: f64,
    pub eps: f64,
    pub weight_decay: f64,
    /// Clip the global gradient norm to this before stepping.
    pub max_grad_norm: Option<f64>,
}

impl AdamWConfig {
    pub fn new(lr: f64, weight_decay: f64, max_grad_norm: Option<f64>) -> Self {
        Self {
            lr,
            beta1: 0.9,
            beta2: 0.999,
            eps: 1e-8,
            weight_decay,
            max_grad_norm,
        }
    }
}

/// AdamW over a `VarStore`'s trainable variables (Loshchilov & Hutter, arXiv 1711.05101; the update of
/// `torch.optim.AdamW`): p ← p·(1 − lr·wd); m ← β1·m + (1 − β1)·g; v ← β2·v + (1 − β2)·g²;
/// p ← p − lr·(m / (1 − β1^t)) / (sqrt(v / (1 − β2^t)) + eps).
pub struct AdamW {
    pub cfg: AdamWConfig,
    vars: Vec<(String, Tensor)>,
    /// The moments, allocated at the first step or restore (empty before): a policy that is only
    /// evaluated or exported never holds two extra copies of its weights.
    m: Vec<Tensor>,
    v: Vec<Tensor>,
    /// Steps taken.
    pub step: u64,
    /// libtorch's own optimiser over the same variables, never stepped: only its `zero_grad`, which
    /// drops the gradients (`set_to_none`, torch.optim's default), is used. Built at the first
    /// [`AdamW::zero_grad`].
    grad_dropper: Option<tch::COptimizer>,
}

impl std::fmt::Debug for AdamW {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("AdamW")
            .field("cfg", &self.cfg)
            .field("vars", &self.vars.len())
            .field("step", &self.step)
            .finish()
    }
}

impl AdamW {
    /// An optimiser for every trainable variable of `vs` (sorted by name, so the order is stable).
    pub fn new(vs: &nn::VarStore, cfg: AdamWConfig) -> Self {
        let mut vars: Vec<(String, Tensor)> = vs
            .variables()
            .into_iter()
            .filter(|(_, t)| t.requires_grad())
            .collect();
        vars.sort_by(|a, b| a.0.cmp(&b.0));
        Self {
            cfg,
            vars,
            m: Vec::new(),
            v: Vec::new(),
            step: 0,
            grad_dropper: None,
        }
    }

    /// True once the moment buffers exist (after a step or a restore).
    pub fn has_state(&self) -> bool {
        !self.m.is_empty() || self.vars.is_empty()
    }

    fn ensure_state(&mut self) {
        if self.m.len() != self.vars.len() {
            self.m = self
                .vars
                .iter()
                .map(|(_, t)| t.zeros_like().detach())
                .collect();
            self.v = self
                .vars
                .iter()
                .map(|(_, t)| t.zeros_like().detach())
                .collect();
        }
    }

    /// The trainable variables, sorted by name (shallow handles).
    pub fn parameters(&self) -> Vec<Tensor> {
        self.vars.iter().map(|(_, t)| t.shallow_clone()).collect()
    }

    /// The moment buffers (allocated as zeros if they do not exist yet), as shallow handles that
    /// write through: what the learner's ranks broadcast after a resume.
    pub fn moments_mut(&mut self) -> Vec<Tensor> {
        self.ensure_state();
        self.m
            .iter()
            .chain(&self.v)
            .map(Tensor::shallow_clone)
            .collect()
    }

    /// Drops the gradients, as `torch.optim`'s `zero_grad()` does by default (`set_to_none`): the
    /// next backward then writes each gradient instead of adding it to zeros, which saves a fill
    /// and an add pass over the model's size per step (0.5 GB each way for SmolLM2), and a variable
    /// that gets no gradient is left alone by the next [`AdamW::step`], as in PyTorch. tch has no
    /// call for it on a tensor, so a never-stepped libtorch optimiser over the same variables does
    /// it; should that fail to build, the gradients are zeroed in place instead.
    pub fn zero_grad(&mut self) {
        if self.grad_dropper.is_none() {
            self.grad_dropper = Self::dropper(&self.vars);
        }
        let dropped = self
            .grad_dropper
            .as_ref()
            .is_some_and(|o| o.zero_grad().is_ok());
        if !dropped {
            for (_, p) in &mut self.vars {
                p.zero_grad();
            }
        }
    }

    /// Gives every variable without a gradient a zero one: what a backward of a loss that is zero
    /// by construction (every advantage 0) would have left, so that the next [`AdamW::step`] moves
    /// the weights by their momentum as `torch.optim.AdamW` does after such a backward, without
    /// running that backward. Costs one fill over the model's size.
    pub fn zero_gradients_where_missing(&mut self) {
        let missing: Vec<&Tensor> = self
            .vars
            .iter()
            .map(|(_, p)| p)
            .filter(|p| p.requires_grad() && !p.grad().defined())
            .collect();
        let Some(total) = missing
            .iter()
            .map(|p| p.sum(Kind::Float) * 0.0)
            .reduce(|a, b| a + b)
        else {
            return;
        };
        // d(0·Σp)/dp is a zero tensor of p's shape, which autograd stores contiguous as p's gradient.
        total.backward();
    }

    fn dropper(vars: &[(String, Tensor)]) -> Option<tch::COptimizer> {
        let mut opt = tch::COptimizer::sgd(0.0, 0.0, 0.0, 0.0, false).ok()?;
        for (_, p) in vars {
            opt.add_parameters(p, 0).ok()?;
        }
        Some(opt)
    }

    /// The global L2 norm of the current gradients (accumulated in f64, reading each gradient once
    /// without temporaries).
    pub fn grad_norm(&self) -> f64 {
        let threads = tch::get_num_threads().max(1) as usize;
        let mut total = 0.0;
        for (_, p) in &self.vars {
            let g = p.grad();
            if !g.defined() {
                continue;
            }
            total += if g.kind() == Kind::Float
                && g.device() == tch::Device::Cpu
                && g.is_contiguous()
                && g.numel() > 0
            {
                // SAFETY: a contiguous f32 CPU tensor of numel elements, only read while `g` lives.
                let data =
                    unsafe { std::slice::from_raw_parts(g.data_ptr() as *const f32, g.numel()) };
                sum_of_squares_f64(data, threads)
            } else {
                g.norm_scalaropt_dtype(2.0, Kind::Double)
                    .double_value(&[])
                    .powi(2)
            };
        }
        total.sqrt()
    }

    /// True when every gradient is finite (a sum of f32 squares in f64 cannot overflow, so a finite
    /// norm means finite gradients).
    pub fn grads_finite(&self) -> bool {
        self.grad_norm().is_finite()
    }

    /// One AdamW step from the accumulated gradients (clipping them first if configured); returns the
    /// gradient norm before clipping.
    pub fn step(&mut self) -> f64 {
        let norm = self.grad_norm();
        self.step_with_norm(norm)
    }

    /// [`AdamW::step`] given the current gradients' [`AdamW::grad_norm`], for a caller that has
    /// just measured it (to check it is finite): the norm is one more read of every gradient.
    pub fn step_with_norm(&mut self, norm: f64) -> f64 {
        let clip_coef = match self.cfg.max_grad_norm {
            Some(max) if norm > max => max / (norm + 1e-6),
            _ => 1.0,
        };
        self.ensure_state();
        self.step += 1;
        let t = self.step as i32;
        let c = self.cfg;
        let bc1 = 1.0 - c.beta1.powi(t);
        let bc2: f64 = 1.0 - c.beta2.powi(t);
        let scalars = AdamWStep {
            lr: c.lr,
            beta1: c.beta1,
            beta2: c.beta2,
            eps: c.eps,
            weight_decay: c.weight_decay,
            bias_correction1: bc1,
            bias_correction2: bc2,
            grad_scale: clip_coef,
        };
        let threads = tch::get_num_threads().max(1) as usize;
        tch::no_grad(|| {
            for (i, (_, p)) in self.vars.iter_mut().enumerate() {
                let g = p.grad();
                if !g.defined() {
                    continue;
                }
                if !one_pass_update(p, &g, &self.m[i], &self.v[i], &scalars, threads) {
                    ops_update(p, g, &mut self.m[i], &mut self.v[i], &scalars);
                }
            }
        });
        norm
    }

    /// The moment buffers by variable name (`{name}.exp_avg`, `{name}.exp_avg_sq`) for checkpoints
    /// (zeros before the first step, as `torch.optim.AdamW` would have them).
    pub fn state_tensors(&self) -> BTreeMap<String, Tensor> {
        let mut out = BTreeMap::new();
        for (i, (name, p)) in self.vars.iter().enumerate() {
            let (m, v) = match (self.m.get(i), self.v.get(i)) {
                (Some(m), Some(v)) => (m.shallow_clone(), v.shallow_clone()),
                _ => (p.zeros_like().detach(), p.zeros_like().detach()),
            };
            out.insert(format!("{name}.exp_avg"), m);
            out.insert(format!("{name}.exp_avg_sq"), v);
        }
        out
    }

    /// Restores the moment buffers and the step count written by [`AdamW::state_tensors`].
    pub fn load_state(
        &mut self,
        tensors: &BTreeMap<String, Tensor>,
        step: u64,
    ) -> Result<(), String> {
        self.ensure_state();
        for (i, (name, p)) in self.vars.iter().enumerate() {
            for (suffix, buf) in [("exp_avg", &mut self.m[i]), ("exp_avg_sq", &mut self.v[i])] {
                let key = format!("{name}.{suffix}");
                let t = tensors
                    .get(&key)
                    .ok_or_else(|| format!("optimiser state lacks `{key}`"))?;
                if t.size() != p.size() {
                    return Err(format!(
                        "optimiser state `{key}` has shape {:?}, the variable {:?}",
                        t.size(),
                        p.size()
                    ));
                }
                *buf = t.to_kind(p.kind()).to_device(p.device()).detach();
            }
        }
        self.step = step;
        Ok(())
    }
}

/// The update in one pass over contiguous f32 CPU buffers ([`adamw_f32`]); false (nothing done) for
/// any other tensors.
fn one_pass_update(
    p: &Tensor,
    g: &Tensor,
    m: &Tensor,
    v: &Tensor,
    s: &AdamWStep,
    threads: usize,
) -> bool {
    let fits = |t: &Tensor| {
        t.kind() == Kind::Float
            && t.device() == tch::Device::Cpu
            && t.is_contiguous()
            && t.numel() == p.numel()
    };
    if p.numel() == 0 || ![p, g, m, v].into_iter().all(fits) {
        return false;
    }
    let n = p.numel();
    // SAFETY: four distinct contiguous f32 CPU tensors of n elements (the optimiser owns `m` and `v`;
    // `p` and its gradient are separate storages), not otherwise touched during the update.
    unsafe {
        let slice = |t: &Tensor| std::slice::from_raw_parts_mut(t.data_ptr() as *mut f32, n);
        adamw_f32(slice(p), slice(g), slice(m), slice(v), s, threads);
    }
    true
}

/// The same update through libtorch ops (other dtypes and devices), in `torch.optim.AdamW`'s
/// single-tensor order (lerp for the first moment, then the second, then the step).
fn ops_update(p: &mut Tensor, g: Tensor, m: &mut Tensor, v: &mut Tensor, s: &AdamWStep) {
    let g = if s.grad_scale == 1.0 {
        g
    } else {
        g * s.grad_scale
    };
    if s.weight_decay != 0.0 {
        let _ = p.g_mul_scalar_(1.0 - s.lr * s.weight_decay);
    }
    let _ = m.lerp_(&g, 1.0 - s.beta1);
    let _ = v.g_mul_scalar_(s.beta2);
    let _ = v.g_add_(&(g.square() * (1.0 - s.beta2)));
    let denom = v.sqrt() / s.bias_correction2.sqrt() + s.eps;
    let _ = p.g_sub_(&(&*m / denom * (s.lr / s.bias_correction1)));
}
