//! Prints the configuration reference (`docs/src/configuration/reference.md`), generated from the
//! config structs:
//!
//! ```sh
//! cargo run -p cotrain-learner --example config_reference > docs/src/configuration/reference.md
//! ```
//!
//! `cargo test -p cotrain-learner --lib config::reference` fails while the committed file differs.

fn main() {
    print!("{}", cotrain_learner::config::reference::markdown());
}
