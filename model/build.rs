//! Tells the tests which AVX-512 subsets the build machine has (`cfg(host_avx512)`,
//! `cfg(host_avx512_bf16)`): a kernel test that needs one is then marked ignored, with the reason,
//! where the CPU lacks it (cargo test lists it as ignored instead of passing without running). The
//! kernels themselves choose at run time, whatever the build machine had.

fn main() {
    println!("cargo::rustc-check-cfg=cfg(host_avx512)");
    println!("cargo::rustc-check-cfg=cfg(host_avx512_bf16)");
    println!("cargo::rerun-if-changed=build.rs");
    #[cfg(target_arch = "x86_64")]
    {
        // Only when building for the machine itself (tests run where they are built).
        let native = std::env::var("HOST").ok() == std::env::var("TARGET").ok();
        if native && std::arch::is_x86_feature_detected!("avx512f") {
            println!("cargo::rustc-cfg=host_avx512");
            if std::arch::is_x86_feature_detected!("avx512bf16") {
                println!("cargo::rustc-cfg=host_avx512_bf16");
            }
        }
    }
}
