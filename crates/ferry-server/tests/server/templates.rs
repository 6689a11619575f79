//! A request's own `chat_template`, and `continue_final_message` (the last message continued,
//! not closed: the prompt ends with its text, cut as transformers cuts it), on chat and on
//! `/tokenize` with messages; each checked against the tokens of the text the template makes.

use serde_json::json;

use crate::support::{ids, start, Options, MODEL};

/// One line per message, then the assistant's turn.
const TEMPLATE: &str = "{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}\
                        {% if add_generation_prompt %}assistant:{% endif %}";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_requests_template_renders_and_a_final_message_is_continued() {
    let s = start(Options::default()).await;
    let tokens = |text: &str| {
        let body = json!({"model": MODEL, "prompt": text, "add_special_tokens": false});
        let s = &s;
        async move { ids(&s.ok("/tokenize", &body).await["tokens"]) }
    };
    let user = json!({"role": "user", "content": "hi"});
    let prefill = json!({"role": "assistant", "content": "The answer is "});

    let body = json!({"model": MODEL, "messages": [user], "chat_template": TEMPLATE});
    let rendered = ids(&s.ok("/tokenize", &body).await["tokens"]);
    assert_eq!(rendered, tokens("user: hi\nassistant:").await);

    // Continued: the prompt ends with the final message's text, its trailing space kept
    // where the template kept it.
    let body = json!({"model": MODEL, "messages": [user, prefill], "chat_template": TEMPLATE,
                      "continue_final_message": true, "add_generation_prompt": false});
    let continued = ids(&s.ok("/tokenize", &body).await["tokens"]);
    assert_eq!(
        continued,
        tokens("user: hi\nassistant: The answer is ").await
    );
    // The same prompt reaches the engine on chat.
    let mut chat = body.clone();
    chat["max_tokens"] = json!(1);
    chat["return_token_ids"] = json!(true);
    let out = s.ok("/v1/chat/completions", &chat).await;
    assert_eq!(ids(&out["prompt_token_ids"]), continued, "{out}");

    // Bad input names its field.
    let both = json!({"model": MODEL, "messages": [user, prefill],
                      "continue_final_message": true});
    s.expect_error(
        "/v1/chat/completions",
        &both,
        400,
        Some("continue_final_message"),
    )
    .await;
    let broken = json!({"model": MODEL, "messages": [user], "chat_template": "{% for %}"});
    s.expect_error("/v1/chat/completions", &broken, 400, Some("chat_template"))
        .await;
    let dropping = json!({"model": MODEL, "messages": [user, prefill],
                          "chat_template": "{% for m in messages %}{{ m.role }}\n{% endfor %}",
                          "continue_final_message": true, "add_generation_prompt": false});
    s.expect_error("/tokenize", &dropping, 400, Some("continue_final_message"))
        .await;
}
