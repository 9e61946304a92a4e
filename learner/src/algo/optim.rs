//! The optimiser side: AdamW per agent (PyTorch's algorithm, written out so that its state can be
//! checkpointed and restored exactly), optional gradient-norm clipping, the skip-on-NaN update, and
//! the shared-parameter round that steps exactly once after all agents.

use std::collections::BTreeMap;

use cotrain_model::kernels::adamw_f32::{AdamWStep, adamw_f32};
use tch::{Kind, Tensor, nn};
use tracing::warn;

use super::loss::LossTerms;

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
    m: Vec<Tensor>,
    v: Vec<Tensor>,
    /// Steps taken.
    pub step: u64,
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
        let m = vars.iter().map(|(_, t)| t.zeros_like().detach()).collect();
        let v = vars.iter().map(|(_, t)| t.zeros_like().detach()).collect();
        Self {
            cfg,
            vars,
            m,
            v,
            step: 0,
        }
    }

    pub fn zero_grad(&mut self) {
        for (_, p) in &mut self.vars {
            p.zero_grad();
        }
    }

    /// The global L2 norm of the current gradients (accumulated in f64, reading each gradient once
    /// without temporaries).
    pub fn grad_norm(&self) -> f64 {
        let mut total = 0.0;
        for (_, p) in &self.vars {
            let g = p.grad();
            if g.defined() {
                let n = g.norm_scalaropt_dtype(2.0, Kind::Double).double_value(&[]);
                total += n * n;
            }
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
        let clip_coef = match self.cfg.max_grad_norm {
            Some(max) if norm > max => max / (norm + 1e-6),
            _ => 1.0,
        };
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

    /// The moment buffers by variable name (`{name}.exp_avg`, `{name}.exp_avg_sq`) for checkpoints.
    pub fn state_tensors(&self) -> BTreeMap<String, Tensor> {
        let mut out = BTreeMap::new();
        for (i, (name, _)) in self.vars.iter().enumerate() {
            out.insert(format!("{name}.exp_avg"), self.m[i].shallow_clone());
            out.insert(format!("{name}.exp_avg_sq"), self.v[i].shallow_clone());
        }
        out
    }

    /// Restores the moment buffers and the step count written by [`AdamW::state_tensors`].
    pub fn load_state(
        &mut self,
        tensors: &BTreeMap<String, Tensor>,
        step: u64,
    ) -> Result<(), String> {
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

/// What one optimiser round did.
#[derive(Debug, Clone, PartialEq)]
pub enum UpdateOutcome {
    /// The optimiser stepped.
    Stepped { grad_norm: f64, loss: f64 },
    /// The loss or gradients were not finite: no step was taken and the gradients were dropped.
    Skipped { reason: String },
}

/// Back-propagates each mini-batch loss (already weighted by its share of the samples), then steps once.
/// A non-finite loss or gradient skips the whole update with a warning, instead of the original's
/// silent replacement by a constant.
pub fn backward_and_step(opt: &mut AdamW, terms: &[LossTerms], agent: usize) -> UpdateOutcome {
    opt.zero_grad();
    let mut total = 0.0;
    for t in terms {
        let v = t.loss.double_value(&[]);
        if !v.is_finite() {
            opt.zero_grad();
            warn!(agent, loss = v, "non-finite loss, skipping this update");
            return UpdateOutcome::Skipped {
                reason: format!("non-finite loss {v}"),
            };
        }
        total += v;
        t.loss.backward();
    }
    if !opt.grads_finite() {
        opt.zero_grad();
        warn!(agent, "non-finite gradient, skipping this update");
        return UpdateOutcome::Skipped {
            reason: "non-finite gradient".into(),
        };
    }
    let grad_norm = opt.step();
    opt.zero_grad();
    UpdateOutcome::Stepped {
        grad_norm,
        loss: total,
    }
}

/// Shared parameters: every agent's loss (scaled by 1/N, on top of the loss's 1/K: 1/(num_samples·N))
/// accumulates into one set of gradients, and the single optimiser steps exactly once, after the last
/// agent of the round.
#[derive(Debug)]
pub struct SharedRound {
    num_agents: usize,
    seen: Vec<bool>,
    skipped: Option<String>,
    loss: f64,
}

impl SharedRound {
    /// Starts a round (zeroes the gradients).
    pub fn begin(opt: &mut AdamW, num_agents: usize) -> Self {
        opt.zero_grad();
        Self {
            num_agents,
            seen: vec![false; num_agents],
            skipped: None,
            loss: 0.0,
        }
    }

    /// The factor each agent's loss is multiplied by.
    pub fn loss_scale(num_agents: usize) -> f64 {
        1.0 / num_agents as f64
    }

    /// Back-propagates one agent's (already 1/N-scaled) loss terms.
    pub fn add_agent(&mut self, agent: usize, terms: &[LossTerms]) -> Result<(), String> {
        if agent >= self.num_agents {
            return Err(format!(
                "agent {agent} out of range for {} agents",
                self.num_agents
            ));
        }
        if self.seen[agent] {
            return Err(format!("agent {agent} already contributed to this round"));
        }
        self.seen[agent] = true;
        for t in terms {
            let v = t.loss.double_value(&[]);
            if !v.is_finite() {
                warn!(
                    agent,
                    loss = v,
                    "non-finite loss, the shared update of this round will be skipped"
                );
                self.skipped
                    .get_or_insert(format!("non-finite loss {v} (agent {agent})"));
                continue;
            }
            if self.skipped.is_none() {
                self.loss += v;
                t.loss.backward();
            }
        }
        Ok(())
    }

    /// Steps once if every agent contributed; an error if some did not.
    pub fn finish(self, opt: &mut AdamW) -> Result<UpdateOutcome, String> {
        if let Some(missing) = self.seen.iter().position(|s| !s) {
            return Err(format!(
                "shared round finished before agent {missing} contributed"
            ));
        }
        if let Some(reason) = self.skipped {
            opt.zero_grad();
            return Ok(UpdateOutcome::Skipped { reason });
        }
        if !opt.grads_finite() {
            opt.zero_grad();
            warn!("non-finite gradient, skipping the shared update");
            return Ok(UpdateOutcome::Skipped {
                reason: "non-finite gradient".into(),
            });
        }
        let grad_norm = opt.step();
        opt.zero_grad();
        Ok(UpdateOutcome::Stepped {
            grad_norm,
            loss: self.loss,
        })
    }
}
