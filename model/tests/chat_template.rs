//! Chat templates rendered byte-identically to transformers' `apply_chat_template(tokenize=False)`
//! (fixtures from scripts/reference/chat_templates.py), plus the HF-specific template functions.

use std::path::{Path, PathBuf};

use cotrain_model::chat_template::{
    ChatMessage, ChatTemplate, ChatTemplateError, parse_json_ordered,
};
use cotrain_model::gguf::GgufFile;
use minijinja::Value;

fn fixture(rel: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures")
        .join(rel)
}

struct Reference {
    /// Key order preserved (tool schemas must keep theirs for `tojson`).
    ordered: Value,
    plain: serde_json::Value,
}

fn reference() -> Reference {
    let text = std::fs::read_to_string(fixture("chat_templates/reference.json")).unwrap();
    Reference {
        ordered: parse_json_ordered(&text).unwrap(),
        plain: serde_json::from_str(&text).unwrap(),
    }
}

/// Renders every case of `name` both through the ordered-value API and, where no tool schema is
/// involved, through the typed `ChatMessage` API.
fn check_cases(template: &ChatTemplate, name: &str) -> usize {
    let r = reference();
    let ordered = r.ordered.get_attr(name).unwrap();
    let plain = &r.plain[name];
    let n = plain["cases"].as_array().unwrap().len();
    for i in 0..n {
        let case = &plain["cases"][i];
        let case_name = case["name"].as_str().unwrap();
        let want = case["expected"].as_str().unwrap();
        let add_gen = case["add_generation_prompt"].as_bool().unwrap();
        let oc = ordered
            .get_attr("cases")
            .unwrap()
            .get_item(&Value::from(i))
            .unwrap();
        let got = template
            .render_values(
                oc.get_attr("messages").unwrap(),
                add_gen,
                oc.get_attr("extra").unwrap(),
            )
            .unwrap_or_else(|e| panic!("{name}/{case_name}: {e}"));
        assert_eq!(got, want, "{name}/{case_name}");
        if case["extra"].get("tools").is_none() {
            let messages: Vec<ChatMessage> =
                serde_json::from_value(case["messages"].clone()).unwrap();
            let got = template.render(&messages, add_gen, &case["extra"]).unwrap();
            assert_eq!(got, want, "{name}/{case_name} via render");
        }
    }
    n
}

#[test]
fn smollm2_template_matches_transformers() {
    let r = reference();
    let fx = &r.plain["smollm2"];
    let t = ChatTemplate::new(
        fx["source"].as_str().unwrap(),
        fx["bos_token"].as_str(),
        fx["eos_token"].as_str(),
    )
    .unwrap();
    assert_eq!(check_cases(&t, "smollm2"), 7);
    let system_default = t
        .render(&[ChatMessage::user("hi")], true, &serde_json::Value::Null)
        .unwrap();
    assert_eq!(
        system_default,
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n\
         <|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    );
}

#[test]
fn smollm2_template_from_gguf_is_the_reference_one() {
    let Some(path) = std::env::var_os("COTRAIN_DEFAULT_MODEL")
        .map(PathBuf::from)
        .filter(|p| p.exists())
    else {
        eprintln!("skipping: COTRAIN_DEFAULT_MODEL not set or missing");
        return;
    };
    let t = ChatTemplate::from_gguf(&GgufFile::open(path).unwrap()).unwrap();
    let r = reference();
    assert_eq!(t.source(), r.plain["smollm2"]["source"].as_str().unwrap());
    assert_eq!(t.bos_token(), Some("<|im_start|>"));
    assert_eq!(t.eos_token(), Some("<|im_end|>"));
    check_cases(&t, "smollm2");
}

#[test]
fn qwen3_template_matches_transformers_including_thinking_and_tools() {
    let cfg: serde_json::Value = serde_json::from_slice(
        &std::fs::read(fixture("tokenizers/qwen3/tokenizer_config.json")).unwrap(),
    )
    .unwrap();
    let t = ChatTemplate::from_tokenizer_config(&cfg, None).unwrap();
    assert_eq!(t.bos_token(), None);
    assert_eq!(t.eos_token(), Some("<|im_end|>"));
    assert_eq!(check_cases(&t, "qwen3"), 13);
    // The thinking switch really changes the prompt.
    let msgs = [ChatMessage::user("hi")];
    let off = t
        .render(&msgs, true, &serde_json::json!({"enable_thinking": false}))
        .unwrap();
    let on = t
        .render(&msgs, true, &serde_json::json!({"enable_thinking": true}))
        .unwrap();
    assert!(off.ends_with("<think>\n\n</think>\n\n") && !on.contains("<think>"));
}

#[test]
fn qwen25_template_matches_transformers_including_tools() {
    let source = std::fs::read_to_string(fixture("chat_templates/qwen2.5-instruct.jinja")).unwrap();
    let t = ChatTemplate::new(source, None, Some("<|im_end|>")).unwrap();
    assert_eq!(check_cases(&t, "qwen2.5"), 9);
}

#[test]
fn hf_dir_prefers_chat_template_jinja_and_reads_named_lists() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = serde_json::json!({
        "bos_token": {"content": "<s>"},
        "eos_token": "</s>",
        "chat_template": [
            {"name": "default", "template": "{{ bos_token }}{% for m in messages %}{{ m.content }}{% endfor %}{{ eos_token }}"},
            {"name": "tool_use", "template": "tools"}
        ]
    });
    std::fs::write(dir.path().join("tokenizer_config.json"), cfg.to_string()).unwrap();
    let t = ChatTemplate::from_hf_dir(dir.path(), None).unwrap();
    assert_eq!(
        t.render(&[ChatMessage::user("x")], false, &serde_json::Value::Null)
            .unwrap(),
        "<s>x</s>"
    );
    let t = ChatTemplate::from_tokenizer_config(&cfg, Some("tool_use")).unwrap();
    assert_eq!(t.source(), "tools");
    let err = ChatTemplate::from_tokenizer_config(&cfg, Some("rag")).unwrap_err();
    assert!(
        matches!(&err, ChatTemplateError::UnknownName { name, available } if name == "rag" && available.len() == 2)
    );

    std::fs::write(
        dir.path().join("chat_template.jinja"),
        "J{{ messages|length }}\n",
    )
    .unwrap();
    let t = ChatTemplate::from_hf_dir(dir.path(), None).unwrap();
    // jinja2 drops one trailing newline of the source, as transformers renders it.
    assert_eq!(
        t.render(&[ChatMessage::user("x")], false, &serde_json::Value::Null)
            .unwrap(),
        "J1"
    );
}

#[test]
fn raise_exception_surfaces_the_template_message() {
    let t = ChatTemplate::new(
        "{% if messages[0].role != 'user' %}{{ raise_exception('Conversation roles must alternate') }}{% endif %}ok",
        None,
        None,
    )
    .unwrap();
    assert_eq!(
        t.render(&[ChatMessage::user("a")], false, &serde_json::Value::Null)
            .unwrap(),
        "ok"
    );
    let err = t
        .render(
            &[ChatMessage::assistant("a")],
            false,
            &serde_json::Value::Null,
        )
        .unwrap_err();
    assert!(matches!(err, ChatTemplateError::Render(_)));
    assert!(
        err.to_string()
            .contains("Conversation roles must alternate"),
        "{err}"
    );
}

#[test]
fn tojson_matches_python_json_dumps() {
    let t = ChatTemplate::new(
        "{{ x | tojson }}|{{ x | tojson(indent=2) }}|{{ [] | tojson }}|{{ {} | tojson(indent=2) }}|{{ x | tojson(sort_keys=true) }}",
        None,
        None,
    )
    .unwrap();
    let extra =
        parse_json_ordered(r#"{"x": {"b": [1, 2.5, true, null], "a": "é\"\n<", "c": 1.0}}"#)
            .unwrap();
    let got = t
        .render_values(Value::from(Vec::<Value>::new()), false, extra)
        .unwrap();
    // Python: json.dumps(x, ensure_ascii=False), with indent=2, [] and {} with indent, sort_keys.
    let want = concat!(
        r#"{"b": [1, 2.5, true, null], "a": "é\"\n<", "c": 1.0}|"#,
        "{\n  \"b\": [\n    1,\n    2.5,\n    true,\n    null\n  ],\n  \"a\": \"é\\\"\\n<\",\n  \"c\": 1.0\n}|",
        "[]|{}|",
        r#"{"a": "é\"\n<", "b": [1, 2.5, true, null], "c": 1.0}"#
    );
    assert_eq!(got, want);
}

#[test]
fn python_string_methods_and_loop_controls_work() {
    let t = ChatTemplate::new(
        "{% for m in messages %}{% if loop.index0 == 1 %}{% break %}{% endif %}\
         {{ m.content.strip().split(',')[0].upper() }}{% endfor %}|{{ strftime_now('%Y')|length }}",
        None,
        None,
    )
    .unwrap();
    let msgs = [ChatMessage::user("  ab,cd "), ChatMessage::user("skipped")];
    assert_eq!(
        t.render(&msgs, false, &serde_json::Value::Null).unwrap(),
        "AB|4"
    );
}

#[test]
fn syntax_errors_and_bad_extra_are_typed() {
    assert!(matches!(
        ChatTemplate::new("{% for %}", None, None),
        Err(ChatTemplateError::Syntax(_))
    ));
    let t = ChatTemplate::new("x", None, None).unwrap();
    assert!(matches!(
        t.render(&[], false, &serde_json::json!([1])),
        Err(ChatTemplateError::ExtraNotObject(_))
    ));
}
