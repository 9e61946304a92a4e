//! `--resume` continues a run only with the config it was started with: a resumed run that silently
//! took another learning rate, dataset or model would be neither run. Keys that do not change what is
//! trained (how long, how often to log or evaluate, where services are) may differ; every other
//! difference is refused, naming each key.

use serde_yaml_ng::Value;

/// Keys (dotted, `*` matches one segment) that may change when a run is resumed.
pub const RESUMABLE_KEYS: &[&str] = &[
    "*.num_train_epochs",
    "*.eval_interval",
    "*.eval_num_samples",
    "*.logging_steps",
    "*.save_steps",
    "output.base_dir",
    "output.save_final_model",
    "output.verbose",
    "output.save_total_limit",
    "logging.*",
    "wandb.*",
    "dataset.data_dir",
    "dataset.eval_split",
    "rollout.endpoints",
    "rollout.dns_name",
    "rollout.dns_refresh_secs",
    "rollout.request_timeout_secs",
    "rollout.max_retries",
    "rollout.weight_transport",
    "rollout.wait_for_registration",
    "rollout.min_workers",
    "rollout.registration_timeout_secs",
    "learner.control_addr",
    "learner.collective_timeout_secs",
    "reward.endpoint",
    "reward.request_timeout_secs",
    "reward.max_retries",
];

/// One key whose value differs between the run's config and the given one.
#[derive(Debug, Clone, PartialEq)]
pub struct ConfigChange {
    pub key: String,
    /// The value in the run's config (YAML, one line), `(absent)` when missing.
    pub was: String,
    pub now: String,
}

/// Every leaf key that differs between `run` (the config the run was started with) and `given`,
/// except those matching [`RESUMABLE_KEYS`].
pub fn forbidden_changes(run: &Value, given: &Value) -> Vec<ConfigChange> {
    let mut out = Vec::new();
    diff(run, given, &mut Vec::new(), &mut out);
    out.retain(|c| !RESUMABLE_KEYS.iter().any(|pat| key_matches(pat, &c.key)));
    out
}

fn key_matches(pattern: &str, key: &str) -> bool {
    let p: Vec<&str> = pattern.split('.').collect();
    // A list entry (`rollout.endpoints[1]`) counts as its list's key.
    let k: Vec<&str> = key
        .split('.')
        .map(|s| s.split_once('[').map_or(s, |(name, _)| name))
        .collect();
    // A pattern names a key or any key below it.
    k.len() >= p.len() && p.iter().zip(&k).all(|(a, b)| *a == "*" || a == b)
}

fn show(v: Option<&Value>) -> String {
    match v {
        None => "(absent)".into(),
        Some(v) => serde_yaml_ng::to_string(v)
            .map(|s| s.trim().replace('\n', " "))
            .unwrap_or_default(),
    }
}

fn diff(a: &Value, b: &Value, path: &mut Vec<String>, out: &mut Vec<ConfigChange>) {
    match (a, b) {
        (Value::Mapping(ma), Value::Mapping(mb)) => {
            let mut keys: Vec<String> = ma
                .keys()
                .chain(mb.keys())
                .filter_map(|k| k.as_str().map(str::to_string))
                .collect();
            keys.sort();
            keys.dedup();
            for k in keys {
                let (va, vb) = (ma.get(k.as_str()), mb.get(k.as_str()));
                path.push(k);
                match (va, vb) {
                    (Some(x), Some(y)) => diff(x, y, path, out),
                    (x, y) if is_nullish(x) && is_nullish(y) => {}
                    (x, y) => out.push(ConfigChange {
                        key: path.join("."),
                        was: show(x),
                        now: show(y),
                    }),
                }
                path.pop();
            }
        }
        // Lists of the same length (`model.agents`) are compared entry by entry, so the change is
        // named down to its key (`model.agents[1].temperature`).
        (Value::Sequence(sa), Value::Sequence(sb)) if sa.len() == sb.len() && a != b => {
            for (i, (x, y)) in sa.iter().zip(sb).enumerate() {
                let last = path.pop().unwrap_or_default();
                path.push(format!("{last}[{i}]"));
                diff(x, y, path, out);
                path.pop();
                path.push(last);
            }
        }
        _ if a == b => {}
        _ => out.push(ConfigChange {
            key: path.join("."),
            was: show(Some(a)),
            now: show(Some(b)),
        }),
    }
}

fn is_nullish(v: Option<&Value>) -> bool {
    v.is_none_or(Value::is_null)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn y(s: &str) -> Value {
        serde_yaml_ng::from_str(s).unwrap()
    }

    #[test]
    fn run_changing_keys_are_named_and_schedule_keys_pass() {
        let run = y(
            "magrpo: {learning_rate: 1.0e-5, num_train_epochs: 2, save_steps: 10}\nmodel: {name: a}\nlogging: {run_name: x}\n",
        );
        let given = y(
            "magrpo: {learning_rate: 2.0e-5, num_train_epochs: 4, save_steps: 5}\nmodel: {name: b}\nlogging: {run_name: y}\n",
        );
        let keys: Vec<String> = forbidden_changes(&run, &given)
            .into_iter()
            .map(|c| c.key)
            .collect();
        assert_eq!(keys, vec!["magrpo.learning_rate", "model.name"]);
        assert!(forbidden_changes(&run, &run).is_empty());
        let agents = |t: f64| {
            y(&format!(
                "model: {{name: a, agents: [{{name: a}}, {{name: a, temperature: {t}}}]}}\n"
            ))
        };
        let keys: Vec<String> = forbidden_changes(&agents(0.5), &agents(0.9))
            .into_iter()
            .map(|c| c.key)
            .collect();
        assert_eq!(keys, vec!["model.agents[1].temperature"]);
        let endpoints = |e: &str| y(&format!("rollout: {{endpoints: ['http://{e}:1']}}\n"));
        assert!(
            forbidden_changes(&endpoints("a"), &endpoints("b")).is_empty(),
            "a list entry of a resumable key"
        );
        let c = &forbidden_changes(&y("a: {b: 1}"), &y("a: {}"))[0];
        assert_eq!(
            (c.key.as_str(), c.was.as_str(), c.now.as_str()),
            ("a.b", "1", "(absent)")
        );
    }
}
