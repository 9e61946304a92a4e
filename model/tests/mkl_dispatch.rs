//! The MKL dispatch patch (`cotrain_model::mkl_dispatch`) in a process of its own: it applies exactly
//! where it should, the matmuls MKL then computes are right, and `COTRAIN_MKL_AVX512=0` turns it off.
//!
//! Every test calls `prefer_avx512()` first: MKL fixes its code path at its first call, and the tests
//! of this binary run on parallel threads, so whichever starts first must not reach MKL unpatched.

use std::process::Command;

use cotrain_model::mkl_dispatch::{Dispatch, ENV_SWITCH, prefer_avx512};
use tch::Tensor;

fn tuned() -> Dispatch {
    // SAFETY: every test of this binary calls this before touching libtorch, and the patch is made
    // once under a `OnceLock`: the other tests' threads wait for it and none is inside MKL yet.
    unsafe { prefer_avx512() }
}

// ---- A: the patch applies exactly on non-Intel CPUs with MKL's AVX-512 subsets ----

fn switched_off() -> bool {
    std::env::var(ENV_SWITCH).is_ok_and(|v| {
        matches!(
            v.trim().to_ascii_lowercase().as_str(),
            "0" | "false" | "off"
        )
    })
}

#[cfg(target_arch = "x86_64")]
fn is_intel() -> bool {
    // Leaf 0 spells the vendor in EBX, EDX, ECX; "GenuineIntel" starts with "Genu" in EBX.
    let r = std::arch::x86_64::__cpuid(0);
    let vendor: Vec<u8> = [r.ebx, r.edx, r.ecx]
        .iter()
        .flat_map(|w| w.to_le_bytes())
        .collect();
    vendor == b"GenuineIntel"
}

#[cfg(target_arch = "x86_64")]
fn has_mkl_avx512_subsets() -> bool {
    is_x86_feature_detected!("avx512f")
        && is_x86_feature_detected!("avx512cd")
        && is_x86_feature_detected!("avx512bw")
        && is_x86_feature_detected!("avx512dq")
        && is_x86_feature_detected!("avx512vl")
}

/// `MKL_CBWR_AVX512` and `MKL_CBWR_AVX512_E1` in MKL's `mkl_cbwr.h`.
const AVX512_BRANCHES: [i32; 2] = [12, 14];

/// The code branch MKL's dispatcher picks for this CPU (`MKL_CBWR_*`; 2, "auto", on its generic
/// non-Intel path), from the service function behind `mkl_cbwr_get_auto_branch`; `None` where
/// libtorch does not export it.
fn mkl_auto_branch() -> Option<i32> {
    // SAFETY: a name lookup in the loaded objects; the function takes no arguments and returns an
    // int. It runs MKL's CPU detection, which is why it is called only after `tuned()`.
    unsafe {
        let f = libc::dlsym(
            libc::RTLD_DEFAULT,
            c"mkl_serv_cbwr_get_auto_branch".as_ptr(),
        );
        if f.is_null() {
            return None;
        }
        let f: extern "C" fn() -> libc::c_int = std::mem::transmute(f);
        Some(f())
    }
}

#[test]
#[cfg(target_arch = "x86_64")]
fn the_patch_applies_exactly_on_non_intel_cpus_with_avx512() {
    let outcome = tuned();
    if switched_off() {
        // Someone ran the tests with the switch off; the child test below covers that case.
        assert!(
            matches!(outcome, Dispatch::Unchanged(ref why) if why.starts_with(ENV_SWITCH)),
            "{outcome:?}"
        );
    } else if is_intel() {
        assert_eq!(outcome, Dispatch::Intel);
    } else if has_mkl_avx512_subsets() {
        assert_eq!(outcome, Dispatch::Patched);
        // And MKL itself now picks an AVX-512 branch, not just our symbol answering "Intel".
        if let Some(branch) = mkl_auto_branch() {
            assert!(
                AVX512_BRANCHES.contains(&branch),
                "MKL's auto branch is {branch}, not AVX-512"
            );
        }
    } else {
        assert!(matches!(outcome, Dispatch::Unchanged(_)), "{outcome:?}");
    }
}

// ---- B: whatever path MKL now takes computes right ----

/// A row-major f32 matrix seen through strides, so that transposes happen here, not in libtorch.
struct Mat {
    data: Vec<f32>,
    rows: usize,
    cols: usize,
    row_stride: usize,
    col_stride: usize,
}

impl Mat {
    /// Deterministic values in [-1, 1) from a 64-bit LCG, independent of libtorch's generator.
    fn random(rows: usize, cols: usize, seed: u64) -> Mat {
        let mut state = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
        let data = (0..rows * cols)
            .map(|_| {
                state = state
                    .wrapping_mul(6_364_136_223_846_793_005)
                    .wrapping_add(1_442_695_040_888_963_407);
                ((state >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
            })
            .collect();
        Mat {
            data,
            rows,
            cols,
            row_stride: cols,
            col_stride: 1,
        }
    }

    fn at(&self, r: usize, c: usize) -> f64 {
        f64::from(self.data[r * self.row_stride + c * self.col_stride])
    }

    /// The same storage read as the transpose.
    fn t(self) -> Mat {
        Mat {
            rows: self.cols,
            cols: self.rows,
            row_stride: self.col_stride,
            col_stride: self.row_stride,
            ..self
        }
    }

    /// The storage as a contiguous tensor of its *stored* shape.
    fn stored_tensor(&self) -> Tensor {
        let (r, c) = if self.col_stride == 1 {
            (self.rows, self.cols)
        } else {
            (self.cols, self.rows)
        };
        Tensor::from_slice(&self.data).view([r as i64, c as i64])
    }

    /// A tensor of the logical shape: a `tr()` view of the stored one when transposed, so MKL gets a
    /// transposed operand.
    fn tensor(&self) -> Tensor {
        let t = self.stored_tensor();
        if self.col_stride == 1 { t } else { t.tr() }
    }
}

fn values(t: &Tensor) -> Vec<f32> {
    Vec::<f32>::try_from(&t.contiguous().flatten(0, -1)).expect("an f32 tensor")
}

/// Checks rows `rows` of `got` (a.rows × b.cols, row-major) against an f64 dot product, within 1e-5
/// of Σ|a||b|: the scale of f32 rounding in any summation order, far below any indexing mistake.
fn check_product(what: &str, a: &Mat, b: &Mat, got: &[f32], rows: impl Iterator<Item = usize>) {
    assert_eq!(a.cols, b.rows);
    assert_eq!(got.len(), a.rows * b.cols, "{what}: result size");
    for i in rows {
        for j in 0..b.cols {
            let (mut dot, mut scale) = (0.0f64, 0.0f64);
            for k in 0..a.cols {
                dot += a.at(i, k) * b.at(k, j);
                scale += (a.at(i, k) * b.at(k, j)).abs();
            }
            let err = (f64::from(got[i * b.cols + j]) - dot).abs();
            assert!(
                err <= 1e-5 * scale + 1e-30,
                "{what}: [{i},{j}] = {} but the f64 reference is {dot}",
                got[i * b.cols + j]
            );
        }
    }
}

fn check_matmul(what: &str, a: &Mat, b: &Mat) {
    let got = values(&a.tensor().matmul(&b.tensor()));
    check_product(what, a, b, &got, 0..a.rows);
}

/// The numerical checks, shared with the child process of test C (the other path).
fn check_matmuls() {
    check_matmul(
        "odd shapes",
        &Mat::random(67, 129, 1),
        &Mat::random(129, 250, 2),
    );
    check_matmul("one row", &Mat::random(1, 577, 3), &Mat::random(577, 33, 4));
    check_matmul(
        "long inner dimension",
        &Mat::random(5, 4099, 5),
        &Mat::random(4099, 7, 6),
    );
    check_matmul(
        "Bᵀ (as in linear)",
        &Mat::random(100, 300, 7),
        &Mat::random(77, 300, 8).t(),
    );
    check_matmul(
        "Aᵀ (as in a weight gradient)",
        &Mat::random(130, 61, 9).t(),
        &Mat::random(130, 95, 10),
    );
    check_matmul(
        "Aᵀ·Bᵀ",
        &Mat::random(40, 23, 11).t(),
        &Mat::random(31, 40, 12).t(),
    );

    // The training step's largest layer shape, checked on every 13th row and the last one.
    let (x, w) = (Mat::random(612, 576, 13), Mat::random(576, 1536, 14));
    let got = values(&x.tensor().matmul(&w.tensor()));
    check_product(
        "612×576 · 576×1536",
        &x,
        &w,
        &got,
        (0..612).step_by(13).chain([611]),
    );

    // Batched: three independent products in one bmm.
    let (a, b): (Vec<Mat>, Vec<Mat>) = (0..3)
        .map(|s| (Mat::random(45, 70, 20 + s), Mat::random(70, 33, 30 + s)))
        .unzip();
    let stack = |ms: &[Mat]| Tensor::stack(&ms.iter().map(Mat::tensor).collect::<Vec<_>>(), 0);
    let got = values(&stack(&a).bmm(&stack(&b)));
    for (s, (a, b)) in a.iter().zip(&b).enumerate() {
        let block = &got[s * 45 * 33..(s + 1) * 45 * 33];
        check_product(&format!("bmm batch {s}"), a, b, block, 0..45);
    }

    // linear with a bias (addmm): x·Wᵀ + b.
    let (x, w, bias) = (
        Mat::random(33, 200, 40),
        Mat::random(130, 200, 41).t(),
        Mat::random(1, 130, 42),
    );
    let got = values(
        &x.tensor()
            .linear(&w.stored_tensor(), Some(&bias.stored_tensor().view([130]))),
    );
    let without_bias: Vec<f32> = got
        .iter()
        .enumerate()
        .map(|(i, v)| v - bias.data[i % 130])
        .collect();
    check_product("linear with bias", &x, &w, &without_bias, 0..33);
}

#[test]
fn matmuls_on_mkls_current_path_match_an_f64_reference() {
    let outcome = tuned();
    eprintln!("MKL dispatch: {outcome:?}");
    check_matmuls();
}

// ---- C: COTRAIN_MKL_AVX512=0 keeps MKL's own choice ----

/// Set in the child process of test C: run as the child instead of spawning one.
const CHILD_FLAG: &str = "COTRAIN_MKL_DISPATCH_TEST_CHILD";
const OUTCOME_MARK: &str = "mkl dispatch outcome: ";
const BRANCH_MARK: &str = "mkl auto branch: ";

#[test]
fn the_env_switch_keeps_mkls_own_choice() {
    let outcome = tuned();
    if std::env::var_os(CHILD_FLAG).is_some() {
        // Also check the numbers on the path the switch leaves MKL on (AVX2 on AMD).
        check_matmuls();
        println!("{OUTCOME_MARK}{outcome:?}");
        println!("{BRANCH_MARK}{:?}", mkl_auto_branch());
        return;
    }
    let exe = std::env::current_exe().expect("the test binary's path");
    let output = Command::new(exe)
        .args([
            "--exact",
            "the_env_switch_keeps_mkls_own_choice",
            "--nocapture",
            "--test-threads=1",
        ])
        .env(CHILD_FLAG, "1")
        .env(ENV_SWITCH, "0")
        .output()
        .expect("starting the test binary as a child");
    let stdout = String::from_utf8_lossy(&output.stdout);
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(
        output.status.success(),
        "child failed ({}):\n{stdout}{stderr}",
        output.status
    );
    let reported = |mark: &str| {
        // Anywhere in a line: the harness prints "test … ... " before the test's own output.
        stdout
            .lines()
            .find_map(|l| l.split_once(mark).map(|(_, rest)| rest))
            .unwrap_or_else(|| panic!("the child printed no {mark:?} line:\n{stdout}{stderr}"))
    };
    assert_eq!(
        reported(OUTCOME_MARK),
        format!("{:?}", Dispatch::Unchanged(format!("{ENV_SWITCH}=0")))
    );
    // Without the patch MKL keeps a non-AVX-512 branch on any non-Intel CPU.
    #[cfg(target_arch = "x86_64")]
    if !is_intel()
        && let Some(branch) = reported(BRANCH_MARK)
            .strip_prefix("Some(")
            .and_then(|b| b.strip_suffix(')'))
    {
        let branch: i32 = branch.parse().expect("an integer branch");
        assert!(
            !AVX512_BRANCHES.contains(&branch),
            "with {ENV_SWITCH}=0 MKL still took branch {branch}"
        );
    }
}
