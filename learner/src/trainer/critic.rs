//! The critics of the actor-critic trainers (IAC, MAAC): a causal LM of its own with a value head
//! (comlrl's `CausalLMWithValueHead` with `ValueHead`: one Linear hidden → 1, or Linear, Tanh,
//! Linear with a hidden width; weights N(0, 0.02), biases 0), read on the final hidden state (after
//! the last norm) at the last token of its input, and trained, backbone and head, by one AdamW.

use cotrain_model::loader::{LoadOptions, LoadedModel};
use tch::{Device, Kind, Tensor, nn};

use crate::algo::{AdamW, AdamWConfig};
use crate::error::TrainError;

/// One critic; see the module docs.
pub struct Critic {
    /// The model it was loaded from.
    pub spec: String,
    /// The backbone; its var store also holds the head (`value_head.*`), so that one AdamW and a
    /// checkpoint's one weights file cover both.
    pub model: LoadedModel,
    head: Vec<(Tensor, Tensor)>,
    pub optimizer: AdamW,
}

/// What one critic update did.
#[derive(Debug, Clone, Copy, Default)]
pub struct CriticStats {
    /// mean_k (y_k − V(h_k))² before the update (before `value_loss_coef`).
    pub value_loss: f64,
    pub grad_norm: f64,
}

impl Critic {
    /// Loads `spec` as a trainable backbone and adds a fresh value head, drawn from libtorch's
    /// generator (seed it first); `hidden` adds the head's hidden layer.
    pub fn load(spec: &str, opts: &LoadOptions, hidden: Option<usize>, adam: AdamWConfig) -> Result<Self, TrainError> {
        let mut model = cotrain_model::loader::load(spec, opts).map_err(|e| TrainError::Model(format!("loading critic `{spec}`: {e}")))?;
        let width = model.model.config().hidden_size as i64;
        let kind = model.model.kind();
        let root = model.vs.root() / "value_head";
        let linear = |path: nn::Path, inp: i64, out: i64| {
            let w = path.var("weight", &[out, inp], nn::Init::Randn { mean: 0.0, stdev: 0.02 });
            let b = path.var("bias", &[out], nn::Init::Const(0.0));
            (w, b)
        };
        let mut head = Vec::new();
        let last = match hidden {
            Some(h) => {
                head.push(linear(&root / "pre_projection" / "0", width, h as i64));
                h as i64
            }
            None => width,
        };
        head.push(linear(&root / "value_projection", last, 1));
        // Drawn in f32, then held in the backbone's dtype as upstream casts its head (in place:
        // the handles above stay the variables).
        if kind != Kind::Float {
            model.vs.set_kind(kind);
        }
        let optimizer = AdamW::new(&model.vs, adam);
        Ok(Self { spec: spec.to_string(), model, head, optimizer })
    }

    /// The value at the last token of each row (B,), f64 on the CPU when not `with_grad`.
    pub fn values(&self, rows: &[Vec<u32>], with_grad: bool) -> Result<Tensor, TrainError> {
        let _guard = (!with_grad).then(tch::no_grad_guard);
        let device = self.model.model.device();
        let longest = rows.iter().map(Vec::len).max().unwrap_or(0);
        if rows.is_empty() || rows.iter().any(Vec::is_empty) {
            return Err(TrainError::Model("critic input: every row needs at least one token".into()));
        }
        // Right padding: causal attention keeps it away from every real position.
        let flat: Vec<i64> = rows.iter().flat_map(|r| r.iter().map(|&t| t as i64).chain(std::iter::repeat_n(0, longest - r.len()))).collect();
        let ids = Tensor::from_slice(&flat).view([rows.len() as i64, longest as i64]).to_device(device);
        let hidden = self.model.model.forward_hidden(&ids).map_err(|e| TrainError::Model(format!("critic forward: {e}")))?;
        let last: Vec<i64> = rows.iter().map(|r| r.len() as i64 - 1).collect();
        let index = Tensor::from_slice(&last).to_device(device).view([-1, 1, 1]).expand([-1, 1, hidden.size()[2]], false);
        let mut x = hidden.gather(1, &index, false).squeeze_dim(1);
        for (i, (w, b)) in self.head.iter().enumerate() {
            x = x.linear(w, Some(b));
            if i + 1 < self.head.len() {
                x = x.tanh();
            }
        }
        Ok(x.squeeze_dim(-1))
    }

    /// Rollout-time values of `rows`, no gradient.
    pub fn predict(&self, rows: &[Vec<u32>]) -> Result<Vec<f64>, TrainError> {
        let v = self.values(rows, false)?.to_kind(Kind::Double).to_device(Device::Cpu);
        Vec::<f64>::try_from(&v).map_err(|e| TrainError::Model(format!("critic values: {e}")))
    }

    /// One AdamW step on `coef`·mean_k (targets[k] − V(rows[k]))². A non-finite loss or gradient
    /// skips the step (returned as an error naming it).
    pub fn update(&mut self, rows: &[Vec<u32>], targets: &[f64], coef: f64) -> Result<CriticStats, TrainError> {
        self.optimizer.zero_grad();
        let v = self.values(rows, true)?;
        let y = Tensor::from_slice(targets).to_device(v.device()).to_kind(v.kind());
        let loss = crate::algo::actor_critic::value_loss(&v, &y);
        let value_loss = loss.double_value(&[]);
        if !value_loss.is_finite() {
            return Err(TrainError::Update(format!("critic `{}`: the value loss is {value_loss}; the step is skipped", self.spec)));
        }
        (loss * coef).backward();
        let grad_norm = self.optimizer.grad_norm();
        if !grad_norm.is_finite() {
            self.optimizer.zero_grad();
            return Err(TrainError::Update(format!("critic `{}`: the gradient norm is {grad_norm}; the step is skipped", self.spec)));
        }
        self.optimizer.step_with_norm(grad_norm);
        Ok(CriticStats { value_loss, grad_norm })
    }
}
