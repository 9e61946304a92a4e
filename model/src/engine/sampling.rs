//! Batched sampling with per-row parameters and per-row random numbers.
//!
//! Every row is filtered (temperature, top-k, top-p, min-p) with its own parameters, then one
//! token is drawn by inverse-CDF sampling over the *vocabulary in index order* with a uniform
//! number drawn in Rust from the row's own RNG. Sorting is only used to find per-row
//! thresholds, never to order the CDF, so a row's token depends on its logits, its parameters
//! and its uniform alone — not on which other rows share the batch or which filters they use.

use tch::{Kind, Tensor};

use crate::error::{ModelError, Result};

/// How to turn logits into a token.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct SamplingParams {
    /// Softmax temperature; 0 means greedy (argmax).
    pub temperature: f64,
    /// Keep only the `top_k` most likely tokens; 0 disables.
    pub top_k: usize,
    /// Keep the smallest set of most likely tokens whose probability reaches `top_p`; 1 disables.
    pub top_p: f64,
    /// Drop tokens less likely than `min_p` times the most likely one; 0 disables.
    pub min_p: f64,
}

impl Default for SamplingParams {
    /// Plain sampling at temperature 1.
    fn default() -> Self {
        SamplingParams {
            temperature: 1.0,
            top_k: 0,
            top_p: 1.0,
            min_p: 0.0,
        }
    }
}

impl SamplingParams {
    /// Greedy decoding.
    pub fn greedy() -> Self {
        SamplingParams {
            temperature: 0.0,
            ..Default::default()
        }
    }

    /// Whether this picks the argmax.
    pub fn is_greedy(&self) -> bool {
        self.temperature == 0.0
    }

    /// Rejects out-of-range values.
    pub fn validate(&self) -> Result<()> {
        let bad = |m: String| Err(ModelError::InvalidRequest(m));
        if !(self.temperature >= 0.0 && self.temperature.is_finite()) {
            return bad(format!("temperature {} must be >= 0", self.temperature));
        }
        if !(self.top_p > 0.0 && self.top_p <= 1.0) {
            return bad(format!("top_p {} must be in (0, 1]", self.top_p));
        }
        if !(self.min_p >= 0.0 && self.min_p < 1.0) {
            return bad(format!("min_p {} must be in [0, 1)", self.min_p));
        }
        Ok(())
    }
}

/// Which log-prob is reported for each sampled token.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum LogprobMode {
    /// Under the model: log-softmax of the raw logits (what the learner recomputes).
    #[default]
    Raw,
    /// Under the distribution actually sampled from (after temperature and filters); 0 for
    /// greedy rows.
    Sampling,
}

/// One row of a sampling batch.
#[derive(Debug, Clone, Copy)]
pub(crate) struct RowSpec {
    pub params: SamplingParams,
    pub logprobs: LogprobMode,
    /// Uniform in [0, 1) from the row's RNG.
    pub uniform: f32,
}

/// Samples one token per row of `logits` (B, V). Returns tokens and their log-probs.
/// Each row's `ks[row]` most likely tokens under the raw logits (log-softmax, before temperature
/// or filters, the distribution OpenAI's `top_logprobs` reports), most likely first. Rows with
/// k = 0 get an empty list; when every k is 0 nothing is computed.
pub(crate) fn top_logprobs(logits: &Tensor, ks: &[usize]) -> Result<Vec<Vec<(u32, f32)>>> {
    let kmax = ks.iter().copied().max().unwrap_or(0);
    if kmax == 0 {
        return Ok(vec![Vec::new(); ks.len()]);
    }
    let _guard = tch::no_grad_guard();
    let (_, v) = logits.size2()?;
    let logp = logits.to_kind(Kind::Float).log_softmax(-1, Kind::Float);
    let (values, indices) = logp.topk(kmax.min(v as usize) as i64, -1, true, true);
    let values: Vec<Vec<f32>> = Vec::<Vec<f32>>::try_from(values.to_device(tch::Device::Cpu))?;
    let indices: Vec<Vec<i64>> = Vec::<Vec<i64>>::try_from(indices.to_device(tch::Device::Cpu))?;
    Ok(ks
        .iter()
        .zip(values.into_iter().zip(indices))
        .map(|(&k, (vs, is))| {
            is.into_iter()
                .zip(vs)
                .take(k)
                .map(|(i, v)| (i as u32, v))
                .collect()
        })
        .collect())
}

pub(crate) fn sample(logits: &Tensor, rows: &[RowSpec]) -> Result<(Vec<i64>, Vec<f32>)> {
    let _guard = tch::no_grad_guard();
    #[cfg(target_arch = "x86_64")]
    if let Some(out) = plain::sample(logits, rows) {
        return Ok(out);
    }
    sample_libtorch(logits, rows)
}

/// [`sample`] through libtorch ops: every filter, any device and dtype.
fn sample_libtorch(logits: &Tensor, rows: &[RowSpec]) -> Result<(Vec<i64>, Vec<f32>)> {
    let device = logits.device();
    let (b, v) = logits.size2()?;
    debug_assert_eq!(b as usize, rows.len());
    let raw = logits.to_kind(Kind::Float);
    let greedy_all = rows.iter().all(|r| r.params.is_greedy());
    let argmax = raw.argmax(-1, false);
    let lse = raw.logsumexp(-1, true);
    let want_sampling_lp = rows.iter().any(|r| r.logprobs == LogprobMode::Sampling);

    let (tokens, sampled_lp) = if greedy_all {
        (argmax.shallow_clone(), None)
    } else {
        let f = |xs: Vec<f32>| Tensor::from_slice(&xs).to_device(device).unsqueeze(1);
        let temps = f(rows
            .iter()
            .map(|r| {
                if r.params.is_greedy() {
                    1.0
                } else {
                    r.params.temperature as f32
                }
            })
            .collect());
        let mut x = &raw / &temps;
        let neg_inf = f64::NEG_INFINITY;

        // top-k: drop values below each row's k-th largest.
        let kmax = rows
            .iter()
            .map(|r| r.params.top_k)
            .max()
            .unwrap_or(0)
            .min(v as usize) as i64;
        let mut topk_sorted: Option<Tensor> = None;
        if kmax > 0 {
            let (vals, _) = x.topk(kmax, -1, true, true);
            let kidx: Vec<i64> = rows
                .iter()
                .map(|r| (r.params.top_k.clamp(1, kmax as usize) - 1) as i64)
                .collect();
            let kidx = Tensor::from_slice(&kidx).to_device(device).unsqueeze(1);
            let has_k: Vec<bool> = rows.iter().map(|r| r.params.top_k > 0).collect();
            let has_k = Tensor::from_slice(&has_k).to_device(device).unsqueeze(1);
            let thr = vals
                .gather(1, &kidx, false)
                .where_scalarother(&has_k, neg_inf);
            x = x.masked_fill(&x.lt_tensor(&thr), neg_inf);
            let sorted = vals.masked_fill(&vals.lt_tensor(&thr), neg_inf);
            topk_sorted = Some(sorted);
        }

        // top-p: keep the sorted prefix whose preceding mass is below p.
        if rows
            .iter()
            .any(|r| r.params.top_p < 1.0 && !r.params.is_greedy())
        {
            let covered = rows
                .iter()
                .all(|r| r.params.top_p >= 1.0 || r.params.top_k > 0);
            let sorted = match (&topk_sorted, covered) {
                (Some(s), true) => s.shallow_clone(),
                _ => x.sort(-1, true).0,
            };
            let p = sorted.softmax(-1, Kind::Float);
            let before = p.cumsum(-1, Kind::Float) - &p;
            let top_p = f(rows
                .iter()
                .map(|r| {
                    if r.params.top_p >= 1.0 {
                        2.0
                    } else {
                        r.params.top_p as f32
                    }
                })
                .collect());
            let keep = before
                .lt_tensor(&top_p)
                .sum_dim_intlist(-1, true, Kind::Int64);
            let thr = sorted.gather(1, &(keep - 1).clamp_min(0), false);
            x = x.masked_fill(&x.lt_tensor(&thr), neg_inf);
        }

        // min-p: drop tokens below min_p times the top probability.
        if rows.iter().any(|r| r.params.min_p > 0.0) {
            let p = x.softmax(-1, Kind::Float);
            let pmax = p.amax(-1, true);
            let min_p = f(rows.iter().map(|r| r.params.min_p as f32).collect());
            x = x.masked_fill(&p.lt_tensor(&(pmax * min_p)), neg_inf);
        }

        // Inverse CDF over the vocabulary in index order.
        let probs = x.softmax(-1, Kind::Float);
        let cdf = probs.cumsum(-1, Kind::Float);
        let total = cdf.narrow(1, v - 1, 1);
        let u = f(rows.iter().map(|r| r.uniform).collect()) * &total;
        let sampled = u
            .searchsorted(&cdf, false, true, "right", None::<Tensor>)
            .clamp_max(v - 1)
            .squeeze_dim(1);
        let greedy: Vec<bool> = rows.iter().map(|r| r.params.is_greedy()).collect();
        let greedy = Tensor::from_slice(&greedy).to_device(device);
        let tokens = argmax.where_self(&greedy, &sampled);
        let lp = if want_sampling_lp {
            Some(
                x.log_softmax(-1, Kind::Float)
                    .gather(1, &tokens.unsqueeze(1), false)
                    .squeeze_dim(1)
                    .where_scalarother(&greedy.logical_not(), 0.0),
            )
        } else {
            None
        };
        (tokens, lp)
    };

    let raw_lp = (raw.gather(1, &tokens.unsqueeze(1), false) - &lse).squeeze_dim(1);
    let lp = match sampled_lp {
        Some(s) => {
            let modes: Vec<bool> = rows
                .iter()
                .map(|r| r.logprobs == LogprobMode::Sampling)
                .collect();
            s.where_self(&Tensor::from_slice(&modes).to_device(device), &raw_lp)
        }
        None => {
            if want_sampling_lp {
                // All greedy: the sampling distribution is a point mass.
                let modes: Vec<bool> = rows
                    .iter()
                    .map(|r| r.logprobs == LogprobMode::Sampling)
                    .collect();
                raw_lp.where_scalarother(
                    &Tensor::from_slice(&modes).to_device(device).logical_not(),
                    0.0,
                )
            } else {
                raw_lp
            }
        }
    };
    let tokens: Vec<i64> = Vec::<i64>::try_from(&tokens.to_device(tch::Device::Cpu))?;
    let lp: Vec<f32> = Vec::<f32>::try_from(&lp.to_device(tch::Device::Cpu))?;
    Ok((tokens, lp))
}

/// Sampling of f32 logits on the CPU, row by row on flat slices: greedy, temperature, and top-k,
/// top-p and min-p without sorting the vocabulary (see `apply_filters`). The libtorch route above
/// makes some ten passes over the (B, V) logits and, for top-p without top-k, sorts every row of the
/// whole vocabulary at every step. The same semantics: the first maximal logit for greedy rows,
/// otherwise the inverse CDF of the tempered, filtered softmax in vocabulary order at the row's
/// uniform; log-probs under the raw logits, or under the sampling distribution on request.
#[cfg(target_arch = "x86_64")]
mod plain {
    use tch::{Device, Kind, Tensor};

    use super::{LogprobMode, RowSpec};
    use crate::kernels::decode_f32::softmax_row;

    pub(super) fn sample(logits: &Tensor, rows: &[RowSpec]) -> Option<(Vec<i64>, Vec<f32>)> {
        // Temperatures so small that 1/T overflows f32 stay with libtorch too.
        let plain = |r: &RowSpec| r.params.is_greedy() || r.params.temperature >= 1e-6;
        if logits.device() != Device::Cpu
            || logits.kind() != Kind::Float
            || !logits.is_contiguous()
            || !rows.iter().all(plain)
        {
            return None;
        }
        let (b, v) = logits.size2().ok()?;
        if b == 0 || b as usize != rows.len() || v == 0 {
            return None;
        }
        let v = v as usize;
        // SAFETY: a contiguous f32 CPU tensor of b·v elements, only read while `logits` lives.
        let all =
            unsafe { std::slice::from_raw_parts(logits.data_ptr() as *const f32, rows.len() * v) };
        let mut out = vec![(0i64, 0f32); rows.len()];
        let out_addr = out.as_mut_ptr() as usize;
        let threads = tch::get_num_threads().max(1) as usize;
        crate::kernels::omp::parallel_for(rows.len(), threads, &|lo, hi| {
            let mut e = vec![0f32; v];
            for r in lo..hi {
                let picked = row(&all[r * v..(r + 1) * v], &rows[r], &mut e);
                // SAFETY: each row index is written by exactly one part; `out` outlives the region.
                unsafe { *(out_addr as *mut (i64, f32)).add(r) = picked };
            }
        });
        Some(out.into_iter().unzip())
    }

    fn row(x: &[f32], spec: &RowSpec, e: &mut [f32]) -> (i64, f32) {
        let (max, sum) = softmax_row(x, 1.0, e);
        let lse = max as f64 + sum.ln();
        let sampling_lp = spec.logprobs == LogprobMode::Sampling;
        if spec.params.is_greedy() {
            let t = x.iter().position(|&l| l == max).unwrap_or(0);
            return (
                t as i64,
                if sampling_lp {
                    0.0
                } else {
                    (x[t] as f64 - lse) as f32
                },
            );
        }
        let temp = spec.params.temperature as f32;
        let (tmax, mut tsum) = if temp == 1.0 {
            (max, sum)
        } else {
            softmax_row(x, 1.0 / temp, e)
        };
        if filtered(&spec.params) {
            tsum = apply_filters(x, &spec.params, e, tsum);
        }
        let t = inverse_cdf(e, spec.uniform as f64 * tsum);
        let lp = if sampling_lp {
            ((x[t] - tmax) / temp) as f64 - tsum.ln()
        } else {
            x[t] as f64 - lse
        };
        (t as i64, lp as f32)
    }

    fn filtered(p: &crate::engine::SamplingParams) -> bool {
        p.top_k > 0 || p.top_p < 1.0 || p.min_p > 0.0
    }

    /// Zeroes the entries of `e` (the tempered, unnormalised probabilities exp((x − max)/T) of the
    /// row's logits `x`, summing to `sum`) that top-k, then top-p, then min-p drop, exactly as the
    /// libtorch route does, without sorting the vocabulary: top-k takes the k-th largest logit by
    /// selection; top-p sorts only the largest candidates, doubling their number until the
    /// nucleus's mass is covered; min-p compares with the row's top probability. Ties with a
    /// threshold are kept. Returns the kept mass.
    fn apply_filters(x: &[f32], p: &crate::engine::SamplingParams, e: &mut [f32], sum: f64) -> f64 {
        let v = x.len();
        let desc = |a: &f32, b: &f32| b.total_cmp(a);
        let mut kept_sum = sum;
        if p.top_k > 0 && p.top_k < v {
            // Tempering preserves order, so the k-th largest logit bounds the kept set.
            let mut c = x.to_vec();
            let (_, kth, _) = c.select_nth_unstable_by(p.top_k - 1, desc);
            let thr = *kth;
            kept_sum = 0.0;
            for (ei, &xi) in e.iter_mut().zip(x) {
                if xi < thr {
                    *ei = 0.0;
                } else {
                    kept_sum += *ei as f64;
                }
            }
        }
        if p.top_p < 1.0 {
            // The kept probabilities in decreasing order, only as far as the nucleus reaches:
            // keep the prefix whose preceding mass is below top_p.
            let kept: Vec<f32> = e.iter().copied().filter(|&q| q > 0.0).collect();
            let target = p.top_p * kept_sum;
            let mut m = kept.len().min(256);
            let thr = loop {
                let mut c = kept.clone();
                if m < c.len() {
                    c.select_nth_unstable_by(m - 1, desc);
                }
                let top = &mut c[..m];
                top.sort_unstable_by(desc);
                let mut before = 0.0f64;
                let mut found = None;
                for (j, &q) in top.iter().enumerate() {
                    if before >= target {
                        found = Some(top[j.max(1) - 1]);
                        break;
                    }
                    before += q as f64;
                }
                match found {
                    Some(t) => break t,
                    None if m == kept.len() => break top[m - 1],
                    None => m = (m * 4).min(kept.len()),
                }
            };
            kept_sum = 0.0;
            for q in e.iter_mut() {
                if *q < thr {
                    *q = 0.0;
                } else {
                    kept_sum += *q as f64;
                }
            }
        }
        if p.min_p > 0.0 {
            // p_i < min_p · p_max  ⇔  e_i < min_p · e_max (the top entry is exp(0) = 1, never dropped).
            let emax = e.iter().copied().fold(0.0f32, f32::max);
            let bound = (p.min_p as f32) * emax;
            kept_sum = 0.0;
            for q in e.iter_mut() {
                if *q < bound {
                    *q = 0.0;
                } else {
                    kept_sum += *q as f64;
                }
            }
        }
        kept_sum
    }

    /// The first index whose running sum of `e` exceeds `target` (skipping whole blocks of 16
    /// while they fall short); the last positive entry if rounding never gets there.
    fn inverse_cdf(e: &[f32], target: f64) -> usize {
        let mut run = 0.0f64;
        for (c, block) in e.chunks(16).enumerate() {
            let s: f32 = block.iter().sum();
            if run + s as f64 > target {
                for (i, &p) in block.iter().enumerate() {
                    run += p as f64;
                    if run > target {
                        return c * 16 + i;
                    }
                }
            } else {
                run += s as f64;
            }
        }
        e.iter().rposition(|&p| p > 0.0).unwrap_or(0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn row(params: SamplingParams, uniform: f32) -> RowSpec {
        RowSpec {
            params,
            logprobs: LogprobMode::Raw,
            uniform,
        }
    }

    #[test]
    fn greedy_picks_argmax_and_reports_raw_logprob() {
        let logits = Tensor::from_slice(&[0.0f32, 2.0, 1.0]).unsqueeze(0);
        let (t, lp) = sample(&logits, &[row(SamplingParams::greedy(), 0.5)]).unwrap();
        assert_eq!(t, vec![1]);
        let expect = 2.0 - (1f32.exp() + 2f32.exp() + 1.0).ln();
        assert!((lp[0] - expect).abs() < 1e-5);
    }

    #[test]
    fn inverse_cdf_follows_vocabulary_order() {
        // Equal probabilities: u in [0, 1/3) -> 0, [1/3, 2/3) -> 1, [2/3, 1) -> 2.
        let logits = Tensor::zeros([3, 3], (Kind::Float, tch::Device::Cpu));
        let p = SamplingParams::default();
        let (t, _) = sample(&logits, &[row(p, 0.1), row(p, 0.5), row(p, 0.9)]).unwrap();
        assert_eq!(t, vec![0, 1, 2]);
    }

    #[test]
    fn filters_apply_per_row_and_do_not_depend_on_neighbours() {
        let base: Vec<f32> = (0..10).map(|i| i as f32 * 0.3).collect();
        let logits = Tensor::from_slice(&base).unsqueeze(0).repeat([3, 1]);
        let k2 = SamplingParams {
            top_k: 2,
            ..Default::default()
        };
        let p_small = SamplingParams {
            top_p: 0.3,
            ..Default::default()
        };
        let plain = SamplingParams::default();
        for u in [0.0f32, 0.3, 0.7, 0.99] {
            let alone_k: Vec<i64> = sample(&logits.narrow(0, 0, 1), &[row(k2, u)]).unwrap().0;
            let alone_plain = sample(&logits.narrow(0, 0, 1), &[row(plain, u)]).unwrap().0;
            let mixed = sample(&logits, &[row(k2, u), row(p_small, u), row(plain, u)])
                .unwrap()
                .0;
            assert_eq!(alone_k[0], mixed[0]);
            assert_eq!(alone_plain[0], mixed[2]);
            assert!(
                mixed[0] >= 8,
                "top-k 2 keeps tokens 8 and 9, got {}",
                mixed[0]
            );
            assert!(
                mixed[1] >= 8,
                "top-p 0.3 keeps the top two here, got {}",
                mixed[1]
            );
        }
    }

    #[test]
    fn min_p_drops_unlikely_tokens() {
        let logits = Tensor::from_slice(&[0.0f32, 5.0, 4.9]).unsqueeze(0);
        let p = SamplingParams {
            min_p: 0.5,
            ..Default::default()
        };
        for u in [0.0f32, 0.2, 0.5, 0.999] {
            let (t, _) = sample(&logits, &[row(p, u)]).unwrap();
            assert!(t[0] == 1 || t[0] == 2);
        }
    }

    /// The slice route agrees with the libtorch route: the same tokens for the same uniforms, and
    /// the same raw and sampling log-probs, for greedy rows and temperatures 1, 0.7 and 1.6.
    #[cfg(target_arch = "x86_64")]
    #[test]
    fn plain_route_matches_the_libtorch_route() {
        tch::manual_seed(7);
        let logits = Tensor::randn([24, 3001], (Kind::Float, tch::Device::Cpu)) * 3.0;
        let temps = [0.0, 1.0, 0.7, 1.6];
        let rows: Vec<RowSpec> = (0..24)
            .map(|i| RowSpec {
                params: SamplingParams {
                    temperature: temps[i % 4],
                    ..Default::default()
                },
                logprobs: if i % 3 == 0 {
                    LogprobMode::Sampling
                } else {
                    LogprobMode::Raw
                },
                uniform: ((i as f32) * 0.618_034).fract(),
            })
            .collect();
        let fast =
            plain::sample(&logits, &rows).expect("plain rows on CPU f32 take the slice route");
        let slow = sample_libtorch(&logits, &rows).unwrap();
        assert_eq!(fast.0, slow.0);
        for (a, b) in fast.1.iter().zip(&slow.1) {
            assert!((a - b).abs() < 1e-4, "log-prob {a} vs {b}");
        }
    }

    /// Top-k, top-p and min-p on slices give the libtorch route's tokens and log-probs, for a grid
    /// of the settings the seeds and OpenAI clients use, over many uniforms.
    #[cfg(target_arch = "x86_64")]
    #[test]
    fn filtered_slice_route_matches_the_libtorch_route() {
        tch::manual_seed(11);
        // A peaked row shape like a language model's (a few likely tokens, a long tail).
        let logits = Tensor::randn([64, 4099], (Kind::Float, tch::Device::Cpu)) * 2.5;
        let grid: [(f64, usize, f64, f64); 9] = [
            (0.7, 0, 0.9, 0.0),
            (0.8, 0, 0.95, 0.0),
            (0.7, 50, 0.9, 0.0),
            (1.0, 50, 1.0, 0.0),
            (0.6, 0, 0.6, 0.0),
            (1.0, 0, 0.999, 0.0),
            (1.3, 20, 1.0, 0.05),
            (0.9, 0, 1.0, 0.1),
            (1.0, 4099, 0.5, 0.0),
        ];
        for (ti, &(temperature, top_k, top_p, min_p)) in grid.iter().enumerate() {
            let rows: Vec<RowSpec> = (0..64)
                .map(|i| RowSpec {
                    params: SamplingParams {
                        temperature,
                        top_k,
                        top_p,
                        min_p,
                    },
                    logprobs: if i % 2 == 0 {
                        LogprobMode::Sampling
                    } else {
                        LogprobMode::Raw
                    },
                    uniform: ((i as f32 + ti as f32 * 0.37) * 0.618_034).fract(),
                })
                .collect();
            let fast = plain::sample(&logits, &rows).expect("CPU f32 rows take the slice route");
            let slow = sample_libtorch(&logits, &rows).unwrap();
            assert_eq!(
                fast.0, slow.0,
                "tokens for T {temperature} top-k {top_k} top-p {top_p} min-p {min_p}"
            );
            for (a, b) in fast.1.iter().zip(&slow.1) {
                assert!(
                    (a - b).abs() < 1e-3,
                    "log-prob {a} vs {b} for T {temperature} top-k {top_k} top-p {top_p}"
                );
            }
        }
    }
}
