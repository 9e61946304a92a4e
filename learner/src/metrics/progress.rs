//! The progress bar of long work (training steps, verifier generation and training): shown on a
//! terminal (`logging.progress: auto`), or always, or never.

use std::io::IsTerminal;

use crate::config::ProgressMode;

/// A bar over `total` units starting at `start`, or None when it is not shown.
pub fn progress_bar(mode: ProgressMode, total: u64, start: u64) -> Option<indicatif::ProgressBar> {
    let show = match mode {
        ProgressMode::Always => true,
        ProgressMode::Never => false,
        ProgressMode::Auto => std::io::stderr().is_terminal(),
    };
    if !show {
        return None;
    }
    let pb = indicatif::ProgressBar::new(total);
    pb.set_style(
        indicatif::ProgressStyle::with_template(
            "{spinner} step {pos}/{len} [{bar:30}] {elapsed_precise} eta {eta_precise} {msg}",
        )
        .unwrap_or_else(|_| indicatif::ProgressStyle::default_bar())
        .progress_chars("=> "),
    );
    pb.set_position(start);
    Some(pb)
}
