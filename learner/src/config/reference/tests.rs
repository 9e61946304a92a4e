//! The reference against the config structs: every key described, the committed page current,
//! anchors as mdBook makes them, the enum stand-ins equal to their enums.
use super::*;
use crate::algo::discussion_score::{AgentShare, Horizon, IncentiveRule};

/// Every object of the schema, with where it is.
fn objects(schema: &Value) -> Vec<(String, &Value)> {
    let mut all = vec![("the top level".to_string(), schema)];
    if let Some(defs) = schema.get("$defs").and_then(Value::as_object) {
        all.extend(defs.iter().map(|(name, s)| (name.clone(), s)));
    }
    all
}

#[test]
fn every_key_has_a_description() {
    let schema = json_schema();
    let mut missing = Vec::new();
    for (owner, object) in objects(&schema) {
        for (key, prop) in object
            .get("properties")
            .and_then(Value::as_object)
            .into_iter()
            .flatten()
        {
            if describe(prop).is_empty() {
                missing.push(format!("{owner}.{key}"));
            }
        }
    }
    assert!(
        missing.is_empty(),
        "config keys without a doc comment (add one to the field): {}",
        missing.join(", ")
    );
}

#[test]
fn committed_reference_is_current() {
    let path = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../docs/src/configuration/reference.md"
    );
    let committed = std::fs::read_to_string(path).unwrap_or_default();
    assert!(
        committed == markdown(),
        "docs/src/configuration/reference.md is not the generator's output; regenerate it from the repository root with:\n  {REGENERATE}"
    );
}

#[test]
fn sections_and_keys_appear_with_their_serde_names() {
    let md = markdown();
    for needle in [
        "## `model`",
        "| `type` |",
        "## `maporl.lora`",
        "## `verifier.lora`",
        "## `prompts.<name>`",
        "## `reward.options`",
    ] {
        assert!(md.contains(needle), "{needle} missing from the reference");
    }
    // `grpo` shares `magrpo`'s keys; `verifier.lora` has its own defaults (r 16, not 8).
    assert!(
        md.contains("The same keys as [`grpo`](#grpo)."),
        "keys are listed alphabetically, so `grpo` comes first"
    );
    let verifier_lora = md.split("## `verifier.lora`").nth(1).unwrap();
    assert!(
        verifier_lora.contains("| `r` | integer | `16` |"),
        "{verifier_lora}"
    );
}

#[test]
fn anchors_follow_mdbook() {
    assert_eq!(anchor("maporl.lora"), "maporllora");
    assert_eq!(anchor("prompts.<name>"), "promptsname");
    assert_eq!(anchor("Top level"), "top-level");
}

/// Each stand-in enum's names are the real enum's: every real variant serialises to a name the
/// stand-in lists (the matches fail to compile when a variant is added), and back.
#[test]
fn enum_stand_ins_match_their_enums() {
    fn names<T: JsonSchema>() -> Vec<String> {
        let s = schemars::generate::SchemaSettings::draft2020_12()
            .into_generator()
            .into_root_schema_for::<T>()
            .to_value();
        enum_values(&s)
            .expect("an enum")
            .into_iter()
            .map(|(v, _)| v)
            .collect()
    }
    fn check<T: serde::Serialize + serde::de::DeserializeOwned + PartialEq + std::fmt::Debug>(
        all: &[T],
        names: Vec<String>,
    ) {
        let real: Vec<String> = all
            .iter()
            .map(|v| {
                serde_json::to_value(v)
                    .unwrap()
                    .as_str()
                    .unwrap()
                    .to_string()
            })
            .collect();
        assert_eq!(real, names);
        for (v, n) in all.iter().zip(&names) {
            assert_eq!(
                &serde_json::from_value::<T>(Value::String(n.clone())).unwrap(),
                v
            );
        }
    }
    let h = |h: Horizon| match h {
        Horizon::Current | Horizon::DiscountedSum | Horizon::Last => h,
    };
    check(
        &[h(Horizon::Current), Horizon::DiscountedSum, Horizon::Last],
        names::<HorizonSchema>(),
    );
    let a = |a: AgentShare| match a {
        AgentShare::All | AgentShare::Individual => a,
    };
    check(
        &[a(AgentShare::All), AgentShare::Individual],
        names::<AgentShareSchema>(),
    );
    let i = |i: IncentiveRule| match i {
        IncentiveRule::Paper | IncentiveRule::ReleasedCode => i,
    };
    check(
        &[i(IncentiveRule::Paper), IncentiveRule::ReleasedCode],
        names::<IncentiveRuleSchema>(),
    );
}
