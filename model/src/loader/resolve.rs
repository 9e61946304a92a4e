//! From a spec string to files: `default` (the embedded model), a directory or `.gguf` path, or
//! an `org/name` repo id in the local Hugging Face hub cache.

use std::path::{Path, PathBuf};

use super::{DEFAULT_MODEL_ENV, DEFAULT_MODEL_RELATIVE, ModelSource};
use crate::error::{ModelError, Result};

/// Resolves a spec (`default`, a path to a directory or `.gguf` file, or an `org/name` repo id
/// in the local Hugging Face cache) to files.
pub fn resolve(spec: &str) -> Result<ModelSource> {
    if spec == "default" {
        return resolve_default();
    }
    let path = Path::new(spec);
    if path.exists() {
        return source_for_path(spec, path);
    }
    if spec.ends_with(".gguf") || spec.starts_with('/') || spec.starts_with('.') {
        return Err(ModelError::MissingFile {
            path: path.to_path_buf(),
            what: "model".into(),
        });
    }
    let parts: Vec<&str> = spec.split('/').collect();
    if parts.len() == 2 && parts.iter().all(|p| !p.is_empty()) {
        return resolve_hf_cache(spec);
    }
    Err(ModelError::Resolve {
        spec: spec.into(),
        message: "not a file, a directory, `default`, or an `org/name` repo id".into(),
    })
}

pub(super) fn source_for_path(spec: &str, path: &Path) -> Result<ModelSource> {
    if path.is_dir() {
        let ggufs: Vec<PathBuf> = std::fs::read_dir(path)
            .map_err(|source| ModelError::Io {
                path: path.into(),
                source,
            })?
            .filter_map(|e| e.ok().map(|e| e.path()))
            .filter(|p| p.extension().is_some_and(|x| x == "gguf"))
            .collect();
        if !path.join("config.json").exists() && ggufs.len() == 1 {
            return Ok(ModelSource::Gguf(ggufs[0].clone()));
        }
        if !path.join("config.json").exists() {
            return Err(ModelError::MissingFile {
                path: path.join("config.json"),
                what: format!("`{spec}` is a directory without a Hugging Face config.json"),
            });
        }
        Ok(ModelSource::HfDir(path.to_path_buf()))
    } else {
        Ok(ModelSource::Gguf(path.to_path_buf()))
    }
}

pub(super) fn resolve_default() -> Result<ModelSource> {
    let path = match std::env::var_os(DEFAULT_MODEL_ENV) {
        Some(p) if !p.is_empty() => PathBuf::from(p),
        _ => home_dir().join(DEFAULT_MODEL_RELATIVE),
    };
    if !path.exists() {
        return Err(ModelError::Resolve {
            spec: "default".into(),
            message: format!(
                "the embedded default model is missing at {}; run `make setup` to fetch it",
                path.display()
            ),
        });
    }
    Ok(ModelSource::Gguf(path))
}

pub(super) fn home_dir() -> PathBuf {
    std::env::var_os("HOME")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from("/"))
}

/// The hub cache directory, in the order `huggingface_hub` uses: `HF_HUB_CACHE`,
/// `HUGGINGFACE_HUB_CACHE`, `$HF_HOME/hub`, `$XDG_CACHE_HOME/huggingface/hub`,
/// `~/.cache/huggingface/hub`.
pub fn hf_hub_cache_dir() -> PathBuf {
    let var = |k: &str| {
        std::env::var_os(k)
            .filter(|v| !v.is_empty())
            .map(PathBuf::from)
    };
    if let Some(p) = var("HF_HUB_CACHE").or_else(|| var("HUGGINGFACE_HUB_CACHE")) {
        return p;
    }
    if let Some(home) = var("HF_HOME") {
        return home.join("hub");
    }
    if let Some(xdg) = var("XDG_CACHE_HOME") {
        return xdg.join("huggingface").join("hub");
    }
    home_dir().join(".cache").join("huggingface").join("hub")
}

/// Finds `org/name` in the local hub cache: `models--org--name/snapshots/<rev>/`, where `<rev>`
/// is the commit `refs/main` points to, or the only/most recent snapshot. No network access.
pub(super) fn resolve_hf_cache(repo_id: &str) -> Result<ModelSource> {
    let cache = hf_hub_cache_dir();
    let repo_dir = cache.join(format!("models--{}", repo_id.replace('/', "--")));
    let err = |message: String| ModelError::Resolve {
        spec: repo_id.into(),
        message,
    };
    if !repo_dir.is_dir() {
        return Err(err(format!(
            "not in the local Hugging Face cache ({} does not exist); download it first, \
             e.g. `huggingface-cli download {repo_id}`",
            repo_dir.display()
        )));
    }
    let snapshots = repo_dir.join("snapshots");
    let from_ref = std::fs::read_to_string(repo_dir.join("refs").join("main"))
        .ok()
        .map(|h| snapshots.join(h.trim()))
        .filter(|p| p.is_dir());
    let snapshot = match from_ref {
        Some(p) => p,
        None => {
            let mut dirs: Vec<(std::time::SystemTime, PathBuf)> = std::fs::read_dir(&snapshots)
                .map_err(|e| err(format!("cannot list {}: {e}", snapshots.display())))?
                .filter_map(|e| e.ok())
                .filter(|e| e.path().is_dir())
                .map(|e| {
                    let t = e
                        .metadata()
                        .and_then(|m| m.modified())
                        .unwrap_or(std::time::UNIX_EPOCH);
                    (t, e.path())
                })
                .collect();
            dirs.sort();
            dirs.pop()
                .map(|(_, p)| p)
                .ok_or_else(|| err(format!("no snapshot under {}", snapshots.display())))?
        }
    };
    source_for_path(repo_id, &snapshot)
}
