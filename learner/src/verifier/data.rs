//! MaPoRL's verifier data file: a JSON object from question to
//! `{"original_answer", "generated_answers": [...], "rewards": [...]}` (rewards 1 correct, 0
//! incorrect; MaPoRL writes −1 for an answer it could not read, which counts as incorrect here).
//! cotrain adds `generated_label` (the answer read from each text) and `row` (the dataset row).
//! JSON objects have no order to serde, but MaPoRL holds out the file's LAST questions, so this
//! reads and writes the entries in the file's order.

use std::fmt;
use std::path::Path;

use serde::de::{MapAccess, Visitor};
use serde::ser::SerializeMap;
use serde::{Deserialize, Deserializer, Serialize, Serializer};

/// One question's answers.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct QuestionEntry {
    /// The dataset's reference solution.
    #[serde(default)]
    pub original_answer: String,
    pub generated_answers: Vec<String>,
    /// One per answer: 1 correct, 0 incorrect (−1 unreadable: incorrect).
    pub rewards: Vec<f64>,
    /// One per answer: the final answer read from it (empty when none).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub generated_label: Vec<String>,
    /// The dataset row the question came from.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub row: Option<usize>,
}

impl QuestionEntry {
    /// Whether answer `i` is correct.
    pub fn correct(&self, i: usize) -> bool {
        self.rewards[i] > 0.5
    }
}

/// One (question, answer, label) to train or evaluate on.
#[derive(Debug, Clone, PartialEq)]
pub struct Example {
    pub question: String,
    pub answer: String,
    /// 1.0 correct, 0.0 incorrect.
    pub label: f32,
}

/// The whole file, in its order.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct VerifierData {
    pub questions: Vec<(String, QuestionEntry)>,
}

impl VerifierData {
    /// Reads and checks a data file (every entry has as many rewards as answers).
    pub fn read(path: &Path) -> Result<Self, String> {
        let text = std::fs::read_to_string(path).map_err(|e| format!("{}: {e}", path.display()))?;
        let data: VerifierData = serde_json::from_str(&text)
            .map_err(|e| format!("{}: not a verifier data file: {e}", path.display()))?;
        for (q, e) in &data.questions {
            if e.rewards.len() != e.generated_answers.len() {
                return Err(format!(
                    "{}: question {:?}: {} answers but {} rewards",
                    path.display(),
                    short(q),
                    e.generated_answers.len(),
                    e.rewards.len()
                ));
            }
        }
        Ok(data)
    }

    /// Writes the file atomically (a temporary file renamed over it), so that a process killed
    /// while writing leaves the previous version.
    pub fn write(&self, path: &Path) -> Result<(), String> {
        let text = serde_json::to_string_pretty(self).map_err(|e| e.to_string())?;
        let tmp = path.with_extension("json.partial");
        if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
            std::fs::create_dir_all(dir).map_err(|e| format!("{}: {e}", dir.display()))?;
        }
        std::fs::write(&tmp, text).map_err(|e| format!("{}: {e}", tmp.display()))?;
        std::fs::rename(&tmp, path).map_err(|e| format!("{}: {e}", path.display()))
    }

    pub fn get(&self, question: &str) -> Option<&QuestionEntry> {
        self.questions
            .iter()
            .find(|(q, _)| q == question)
            .map(|(_, e)| e)
    }

    /// Every answer as an example, question by question.
    pub fn examples(&self) -> Vec<Example> {
        self.questions
            .iter()
            .flat_map(|(q, e)| {
                e.generated_answers
                    .iter()
                    .enumerate()
                    .map(move |(i, a)| Example {
                        question: q.clone(),
                        answer: a.clone(),
                        label: if e.correct(i) { 1.0 } else { 0.0 },
                    })
            })
            .collect()
    }

    /// The first questions and the last `test_questions` (held out), as MaPoRL splits.
    pub fn split(&self, test_questions: usize) -> Result<(VerifierData, VerifierData), String> {
        if test_questions >= self.questions.len() {
            return Err(format!(
                "verifier.test_questions is {test_questions} but the data has {} questions: at least one must remain to train on",
                self.questions.len()
            ));
        }
        let cut = self.questions.len() - test_questions;
        Ok((
            VerifierData {
                questions: self.questions[..cut].to_vec(),
            },
            VerifierData {
                questions: self.questions[cut..].to_vec(),
            },
        ))
    }
}

fn short(q: &str) -> String {
    let s: String = q.chars().take(60).collect();
    if s.len() < q.len() {
        format!("{s}…")
    } else {
        s
    }
}

impl Serialize for VerifierData {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        let mut map = s.serialize_map(Some(self.questions.len()))?;
        for (q, e) in &self.questions {
            map.serialize_entry(q, e)?;
        }
        map.end()
    }
}

impl<'de> Deserialize<'de> for VerifierData {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct InOrder;
        impl<'de> Visitor<'de> for InOrder {
            type Value = VerifierData;
            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str(
                    "an object from question to {original_answer, generated_answers, rewards}",
                )
            }
            fn visit_map<A: MapAccess<'de>>(self, mut m: A) -> Result<VerifierData, A::Error> {
                let mut questions = Vec::new();
                while let Some((q, e)) = m.next_entry::<String, QuestionEntry>()? {
                    questions.push((q, e));
                }
                Ok(VerifierData { questions })
            }
        }
        d.deserialize_map(InOrder)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_file_order_survives_a_round_trip_and_the_last_questions_are_held_out() {
        let text = r#"{"z": {"original_answer": "the answer is 1", "generated_answers": ["a", "b"], "rewards": [1, 0]},
                       "a": {"original_answer": "", "generated_answers": ["c"], "rewards": [-1]},
                       "m": {"generated_answers": [], "rewards": []}}"#;
        let d: VerifierData = serde_json::from_str(text).unwrap();
        assert_eq!(
            d.questions
                .iter()
                .map(|(q, _)| q.as_str())
                .collect::<Vec<_>>(),
            ["z", "a", "m"]
        );
        let back: VerifierData = serde_json::from_str(&serde_json::to_string(&d).unwrap()).unwrap();
        assert_eq!(back, d);
        let labels: Vec<f32> = d.examples().iter().map(|e| e.label).collect();
        assert_eq!(labels, [1.0, 0.0, 0.0], "-1 (unreadable) is incorrect");
        let (train, test) = d.split(1).unwrap();
        assert_eq!(
            (train.questions.len(), test.questions[0].0.as_str()),
            (2, "m")
        );
        assert!(d.split(3).unwrap_err().contains("at least one must remain"));
    }

    #[test]
    fn answers_and_rewards_must_pair_up() {
        let tmp = tempfile::tempdir().unwrap();
        let p = tmp.path().join("bad.json");
        std::fs::write(
            &p,
            r#"{"q": {"generated_answers": ["a", "b"], "rewards": [1]}}"#,
        )
        .unwrap();
        assert!(
            VerifierData::read(&p)
                .unwrap_err()
                .contains("2 answers but 1 rewards")
        );
    }
}
