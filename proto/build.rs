//! Compiles every `.proto` under `proto/proto/` into `OUT_DIR`, plus a descriptor set for
//! gRPC reflection. protoc comes from `protoc-bin-vendored` unless `PROTOC` is set, so the
//! build needs no system package.
use std::path::PathBuf;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    if std::env::var_os("PROTOC").is_none() {
        // SAFETY: build scripts are single-threaded; nothing else reads the environment concurrently.
        unsafe { std::env::set_var("PROTOC", protoc_bin_vendored::protoc_bin_path()?) };
    }
    let dir = PathBuf::from("proto");
    let mut files: Vec<PathBuf> = std::fs::read_dir(&dir)?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|x| x == "proto"))
        .collect();
    files.sort();
    let out = PathBuf::from(std::env::var("OUT_DIR")?);
    tonic_prost_build::configure()
        .file_descriptor_set_path(out.join("cotrain_descriptor.bin"))
        .compile_protos(&files, std::slice::from_ref(&dir))?;
    println!("cargo:rerun-if-changed=proto");
    Ok(())
}
