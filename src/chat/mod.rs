//! Chat and instruction data for fine-tuning: conversations rendered with the tokenizer's own
//! chat template ([`template`]), the tokens of the assistant's answers marked as the ones that
//! count in the loss ([`tokenize`]), and whole conversations packed into sequences
//! ([`pack`]).
//!
//! A JSON line holds `messages` (a list of `{"role", "content"}`), or a `prompt` and a
//! `completion` (strings, taken as a user turn and an assistant turn, or lists of messages),
//! and optionally `tools`.

pub mod pack;
pub mod prepare;
pub mod template;

use anyhow::{Context, Result, bail};
use serde_json::{Map, Value};

use crate::tokenizer::Tokenizer;
pub use template::ChatTemplate;

/// One conversation of a JSON line.
#[derive(Debug, Clone, PartialEq)]
pub struct Conversation {
    /// The messages, as the template sees them.
    pub messages: Vec<Value>,
    /// Tools offered to the model, when the line gives them.
    pub tools: Option<Value>,
}

impl Conversation {
    /// The conversation of a JSON line's object.
    pub fn from_object(object: &Map<String, Value>) -> Result<Conversation> {
        let messages = match (
            object.get("messages"),
            object.get("prompt"),
            object.get("completion"),
        ) {
            (Some(Value::Array(m)), None, None) => m.clone(),
            (Some(_), None, None) => bail!("\"messages\" is not a list"),
            (None, Some(prompt), Some(completion)) => {
                let mut m = turns(prompt, "user", "prompt")?;
                m.extend(turns(completion, "assistant", "completion")?);
                m
            }
            (None, Some(_), None) => bail!("a \"prompt\" without its \"completion\""),
            (None, None, Some(_)) => bail!("a \"completion\" without its \"prompt\""),
            (Some(_), _, _) => bail!("both \"messages\" and \"prompt\"/\"completion\": give one"),
            (None, None, None) => {
                bail!("no \"messages\", and no \"prompt\" and \"completion\"")
            }
        };
        for (i, m) in messages.iter().enumerate() {
            let role = m.get("role").and_then(Value::as_str);
            if role.is_none() {
                bail!("message {i} has no \"role\" string");
            }
        }
        Ok(Conversation {
            messages,
            tools: object.get("tools").cloned(),
        })
    }

    /// The role of message `i`.
    fn role(&self, i: usize) -> &str {
        self.messages[i]
            .get("role")
            .and_then(Value::as_str)
            .unwrap_or_default()
    }

    /// The indices of the assistant's turns.
    pub fn assistant_turns(&self) -> Vec<usize> {
        (0..self.messages.len())
            .filter(|&i| self.role(i) == "assistant")
            .collect()
    }
}

/// A prompt or a completion: a string (one turn of `role`) or a list of messages.
fn turns(v: &Value, role: &str, key: &str) -> Result<Vec<Value>> {
    match v {
        Value::String(s) => Ok(vec![serde_json::json!({"role": role, "content": s})]),
        Value::Array(m) => Ok(m.clone()),
        _ => bail!("\"{key}\" is neither a string nor a list of messages"),
    }
}

/// A document of a conversation as tokens, with which of them count as predicted targets.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Tokenized {
    /// Token ids of the whole rendered conversation.
    pub tokens: Vec<u32>,
    /// Per token, whether the loss of predicting it counts.
    pub counts: Vec<bool>,
}

/// Renders and tokenizes `conversation` with `template` and `tokenizer` (the rendered text
/// encoded without adding special tokens, as `apply_chat_template` does) into the documents it
/// trains as.
///
/// With `answer_only`, the tokens of assistant turn `i` are those of the conversation rendered
/// up to and including turn `i`, less those of the conversation before turn `i` rendered with
/// the generation prompt (TRL's and Megatron-Bridge's rule for templates without generation
/// markers). Where each of those renderings begins the whole conversation's, the conversation
/// is one document with every answer counted. A template that renders a turn differently once
/// later turns follow it (Qwen3 drops earlier turns' thinking) makes one document per assistant
/// turn instead: the conversation rendered up to that turn, only its answer counted, which is
/// the context the model is given when it writes that answer. Without `answer_only` the whole
/// conversation is one document where every token counts but the first (nothing before it
/// predicts it).
pub fn tokenize(
    conversation: &Conversation,
    template: &ChatTemplate,
    tokenizer: &Tokenizer,
    answer_only: bool,
    add_generation_prompt: bool,
) -> Result<Vec<Tokenized>> {
    let turns = conversation.assistant_turns();
    if turns.is_empty() {
        bail!("the conversation has no assistant turn: nothing in it would count in the loss");
    }
    let tools = conversation.tools.as_ref();
    let encode = |messages: &[Value], generation: bool| -> Result<Vec<u32>> {
        let text = template.render(messages, tools, generation)?;
        tokenizer.encode(&text)
    };
    let tokens = encode(&conversation.messages, add_generation_prompt)?;
    if !answer_only {
        let mut counts = vec![true; tokens.len()];
        if let Some(first) = counts.first_mut() {
            *first = false;
        }
        return Ok(vec![Tokenized { tokens, counts }]);
    }
    // Each turn as the rule cuts it: its rendering and where its answer begins.
    let mut answers = Vec::with_capacity(turns.len());
    for i in turns {
        let upto = encode(&conversation.messages[..=i], false)?;
        let prompt = encode(&conversation.messages[..i], true)?;
        if !upto.starts_with(&prompt) {
            bail!(
                "the chat template's generation prompt before assistant turn {i} does not \
                 begin that turn's rendering, so its answer's tokens cannot be told apart \
                 (--answer-only-loss false counts every token)"
            );
        }
        answers.push((upto, prompt.len()));
    }
    if answers.iter().all(|(upto, _)| tokens.starts_with(upto)) {
        let mut counts = vec![false; tokens.len()];
        for (upto, start) in &answers {
            counts[*start..upto.len()].fill(true);
        }
        return Ok(vec![Tokenized { tokens, counts }]);
    }
    Ok(answers
        .into_iter()
        .map(|(tokens, start)| {
            let counts = (0..tokens.len()).map(|k| k >= start).collect();
            Tokenized { tokens, counts }
        })
        .collect())
}

/// [`Conversation::from_object`] of one JSON line, its errors naming the line.
pub fn parse(line: &str, line_no: u64) -> Result<Conversation> {
    let value: Value = serde_json::from_str(line)
        .with_context(|| format!("line {line_no}: not a JSON document"))?;
    let Value::Object(object) = value else {
        bail!("line {line_no}: not a JSON object");
    };
    Conversation::from_object(&object).with_context(|| format!("line {line_no}"))
}
