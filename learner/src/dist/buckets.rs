//! Gradients summed over the ranks in buckets, as PyTorch DDP does: each collective call carries at
//! most one bucket (64 MiB by default), so no rank ever holds a second copy of its gradients, and no
//! count handed to MPI or NCCL exceeds what their C `int` counts hold (a 3B-parameter policy has
//! more than 2^31 gradient elements).
//!
//! A gradient larger than a bucket is reduced where it lies, one bucket-sized slice at a time, when
//! it is an f32 tensor on the collective's device; smaller gradients (norms, biases) are packed into
//! one reused staging bucket on the collective's device, so that they cost one call per bucket
//! instead of one each, and so are gradients of another kind or device (bf16, CPU gradients with
//! NCCL), which are summed in f32 as before. The buckets depend on the gradients' sizes alone, so every rank makes
//! the same calls with the same counts whatever its gradients' layout.

use std::ops::Range;

use tch::{Kind, Tensor};

use super::{Collective, DistError};

/// The most elements one MPI or NCCL call is given: MPI's counts are C `int`s.
pub const MAX_COUNT: usize = i32::MAX as usize;

/// What [`all_reduce_grads`](super::all_reduce_grads) sends per collective call (PyTorch DDP uses
/// 25 MiB; larger buckets need fewer calls, each of which synchronises the ranks).
pub const DEFAULT_BUCKET_BYTES: usize = 64 << 20;

/// `start..end` ranges of at most `max` elements (at least 1) that cover `0..len` in order.
pub fn chunks(len: usize, max: usize) -> impl Iterator<Item = Range<usize>> {
    let max = max.max(1);
    (0..len)
        .step_by(max)
        .map(move |start| start..(start + max).min(len))
}

/// Elements `start..start + len` of gradient `param` (flattened), inside a bucket.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Piece {
    pub param: usize,
    pub start: usize,
    pub len: usize,
}

/// The buckets, in order, for gradients of `numels` elements and buckets of at most `bucket`
/// elements: a gradient larger than a bucket gets buckets of its own, one per `bucket`-sized slice,
/// where it comes; smaller ones fill a shared bucket, which goes when the next does not fit (so the
/// norms and biases between a model's large weights cost a call per bucket, not one each). Empty
/// gradients are left out.
pub fn plan(numels: &[usize], bucket: usize) -> Vec<Vec<Piece>> {
    let bucket = bucket.max(1);
    let mut buckets = Vec::new();
    let mut open: Vec<Piece> = Vec::new();
    let mut filled = 0;
    for (param, &numel) in numels.iter().enumerate() {
        if numel > bucket {
            buckets.extend(chunks(numel, bucket).map(|r| {
                vec![Piece {
                    param,
                    start: r.start,
                    len: r.len(),
                }]
            }));
            continue;
        }
        if numel == 0 {
            continue;
        }
        if filled + numel > bucket {
            buckets.push(std::mem::take(&mut open));
            filled = 0;
        }
        open.push(Piece {
            param,
            start: 0,
            len: numel,
        });
        filled += numel;
    }
    if !open.is_empty() {
        buckets.push(open);
    }
    buckets
}

/// Sums the gradients of `params` over the ranks, in buckets of at most `bucket_bytes` of f32
/// gradient (see the [module docs](self)). Parameters without a gradient on this rank contribute
/// zeros. The extra memory is one bucket on the collective's device (plus, for MPI, one bucket's
/// send copy: see `mpi_backend`).
pub fn all_reduce_grads_bucketed(
    coll: &dyn Collective,
    params: &[Tensor],
    bucket_bytes: usize,
) -> Result<(), DistError> {
    if coll.world() == 1 || params.is_empty() {
        return Ok(());
    }
    give_missing_zero_grads(params)?;
    // Views of the gradients: what is written into them lands in the parameters' gradients.
    let grads = params
        .iter()
        .enumerate()
        .map(|(i, p)| {
            p.grad().f_view([-1]).map_err(|e| {
                DistError(format!(
                    "gradient of parameter {i} (shape {:?}): {e}",
                    p.size()
                ))
            })
        })
        .collect::<Result<Vec<Tensor>, DistError>>()?;
    let numels: Vec<usize> = grads.iter().map(Tensor::numel).collect();
    let buckets = plan(
        &numels,
        (bucket_bytes / std::mem::size_of::<f32>()).min(MAX_COUNT),
    );
    let device = coll.device();
    let in_place = |b: &[Piece]| matches!(b, [p] if grads[p.param].kind() == Kind::Float && grads[p.param].device() == device);
    let staging_len = buckets
        .iter()
        .filter(|b| !in_place(b))
        .map(|b| b.iter().map(|p| p.len).sum::<usize>())
        .max()
        .unwrap_or(0);
    let staging = Tensor::empty([staging_len as i64], (Kind::Float, device));
    let narrow = |t: &Tensor, start: usize, len: usize| t.narrow(0, start as i64, len as i64);
    tch::no_grad(|| {
        for bucket in &buckets {
            if in_place(bucket) {
                let p = bucket[0];
                coll.all_reduce_sum(&mut narrow(&grads[p.param], p.start, p.len))?;
                continue;
            }
            let mut buf = narrow(&staging, 0, bucket.iter().map(|p| p.len).sum());
            let mut at = 0;
            for p in bucket {
                narrow(&buf, at, p.len).copy_(&narrow(&grads[p.param], p.start, p.len));
                at += p.len;
            }
            coll.all_reduce_sum(&mut buf)?;
            at = 0;
            for p in bucket {
                narrow(&grads[p.param], p.start, p.len).copy_(&narrow(&buf, at, p.len));
                at += p.len;
            }
        }
        Ok(())
    })
}

/// A rank without samples has no gradients yet: gives them zeros (a backward of 0·Σp, which
/// autograd stores contiguous) so that the other ranks' sum has somewhere to land.
fn give_missing_zero_grads(params: &[Tensor]) -> Result<(), DistError> {
    let missing: Vec<&Tensor> = params.iter().filter(|p| !p.grad().defined()).collect();
    let Some(zero) = missing
        .iter()
        .map(|p| p.sum(Kind::Float) * 0.0)
        .reduce(|a, b| a + b)
    else {
        return Ok(());
    };
    zero.f_backward()
        .map_err(|e| DistError(format!("zero gradients: {e}")))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pieces(b: &[Piece]) -> Vec<(usize, usize, usize)> {
        b.iter().map(|p| (p.param, p.start, p.len)).collect()
    }

    #[test]
    fn chunks_cover_the_range_in_pieces_of_at_most_max() {
        assert_eq!(chunks(10, 4).collect::<Vec<_>>(), vec![0..4, 4..8, 8..10]);
        assert_eq!(chunks(8, 4).collect::<Vec<_>>(), vec![0..4, 4..8]);
        assert_eq!(chunks(3, 4).collect::<Vec<_>>(), vec![0..3]);
        assert_eq!(chunks(0, 4).count(), 0);
    }

    #[test]
    fn chunks_split_counts_beyond_an_mpi_int() {
        // A 3B-parameter gradient: 3·2^30 elements, more than i32::MAX (2^31 − 1).
        let len = 3usize << 30;
        let parts: Vec<Range<usize>> = chunks(len, MAX_COUNT).collect();
        assert_eq!(parts.len(), 2);
        assert!(parts.iter().all(|r| r.len() <= i32::MAX as usize));
        assert_eq!(parts.iter().map(|r| r.len()).sum::<usize>(), len);
        assert_eq!(parts[1].start, MAX_COUNT);
    }

    #[test]
    fn small_gradients_share_buckets_until_the_next_does_not_fit() {
        // Bucket of 10: 3 + 4 fit, 5 does not (12), 5 + 5 fit, 2 starts the last.
        let plan = plan(&[3, 4, 5, 5, 2], 10);
        let got: Vec<_> = plan.iter().map(|b| pieces(b)).collect();
        assert_eq!(
            got,
            vec![
                vec![(0, 0, 3), (1, 0, 4)],
                vec![(2, 0, 5), (3, 0, 5)],
                vec![(4, 0, 2)]
            ]
        );
    }

    #[test]
    fn a_gradient_larger_than_a_bucket_gets_buckets_of_its_own_while_small_ones_share() {
        // 2 opens the shared bucket; 25 takes 10 + 10 + 5 where it comes; 3 joins 2 at the end;
        // the empty one is left out.
        let plan = plan(&[2, 25, 0, 3], 10);
        let got: Vec<_> = plan.iter().map(|b| pieces(b)).collect();
        assert_eq!(
            got,
            vec![
                vec![(1, 0, 10)],
                vec![(1, 10, 10)],
                vec![(1, 20, 5)],
                vec![(0, 0, 2), (3, 0, 3)]
            ]
        );
    }

    #[test]
    fn the_plan_covers_every_element_once_and_no_bucket_exceeds_its_size() {
        let numels = [1, 7, 64, 0, 33, 8, 8, 100, 5];
        for bucket in [1, 3, 8, 16, 64, 1000] {
            let plan = plan(&numels, bucket);
            let mut seen: Vec<Vec<bool>> = numels.iter().map(|&n| vec![false; n]).collect();
            for b in &plan {
                assert!(
                    !b.is_empty() && b.iter().map(|p| p.len).sum::<usize>() <= bucket,
                    "bucket {bucket}: {b:?}"
                );
                for p in b {
                    for s in &mut seen[p.param][p.start..p.start + p.len] {
                        assert!(!*s, "an element of {} twice", p.param);
                        *s = true;
                    }
                }
            }
            assert!(
                seen.iter().flatten().all(|&s| s),
                "bucket {bucket}: an element was left out"
            );
        }
    }
}
