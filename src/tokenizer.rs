//! Tokenizers for preparing and reading data: the byte-level tokenizer (no files) and Hugging Face
//! `tokenizer.json` files (GPT-2's BPE included), named by a SPEC string.
//!
//! * `byte`: ids 0–255 are the bytes of the UTF-8 text, 256 is the end-of-document token
//!   `<|endoftext|>`; vocabulary 257.
//! * a path to a `tokenizer.json`: encoded without special tokens, as Megatron-LM's
//!   `HuggingFaceTokenizer` does by default; the end-of-document token is `<|endoftext|>` when the
//!   tokenizer has one (or another token named with [`Tokenizer::with_eod_token`]).

use std::fmt;
use std::path::{Path, PathBuf};

use anyhow::{Context, Result, anyhow, bail};
use megatron_core::checkpoint::Files;

/// The end-of-document token's name.
pub const ENDOFTEXT: &str = "<|endoftext|>";

/// The byte-level tokenizer's end-of-document id.
pub const BYTE_EOD: u32 = 256;

/// A tokenizer named by a SPEC string.
pub enum Tokenizer {
    /// Bytes as ids 0–255, `<|endoftext|>` = 256.
    Byte,
    /// A Hugging Face `tokenizer.json`.
    HuggingFace {
        /// The file it was read from.
        path: PathBuf,
        /// The tokenizer.
        tokenizer: Box<tokenizers::Tokenizer>,
        /// The end-of-document id, if any.
        eod: Option<u32>,
    },
}

impl fmt::Debug for Tokenizer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Tokenizer::Byte => f.write_str("Tokenizer::Byte"),
            Tokenizer::HuggingFace { path, eod, .. } => f
                .debug_struct("Tokenizer::HuggingFace")
                .field("path", path)
                .field("vocab_size", &self.vocab_size())
                .field("eod", eod)
                .finish(),
        }
    }
}

impl Tokenizer {
    /// `byte`, or the path of a Hugging Face `tokenizer.json`.
    pub fn from_spec(spec: &str) -> Result<Tokenizer> {
        if spec == "byte" {
            return Ok(Tokenizer::Byte);
        }
        let path = Path::new(spec);
        if !path.is_file() {
            bail!(
                "tokenizer {spec:?}: not `byte` and no such file (give `byte` or the path of a \
                 Hugging Face tokenizer.json)"
            );
        }
        Tokenizer::from_file(path)
    }

    /// A Hugging Face `tokenizer.json`.
    pub fn from_file(path: impl AsRef<Path>) -> Result<Tokenizer> {
        let path = path.as_ref();
        let tokenizer = tokenizers::Tokenizer::from_file(path)
            .map_err(|e| anyhow!("{}: not a readable tokenizer.json: {e}", path.display()))?;
        let eod = tokenizer.token_to_id(ENDOFTEXT);
        Ok(Tokenizer::HuggingFace {
            path: path.to_path_buf(),
            tokenizer: Box::new(tokenizer),
            eod,
        })
    }

    /// The same tokenizer with `token` as its end-of-document token.
    pub fn with_eod_token(self, token: &str) -> Result<Tokenizer> {
        match self {
            Tokenizer::Byte if token == ENDOFTEXT => Ok(Tokenizer::Byte),
            Tokenizer::Byte => {
                bail!("the byte tokenizer's end-of-document token is {ENDOFTEXT}, not {token:?}")
            }
            Tokenizer::HuggingFace {
                path, tokenizer, ..
            } => {
                let Some(id) = tokenizer.token_to_id(token) else {
                    bail!("{}: no token {token:?}", path.display());
                };
                Ok(Tokenizer::HuggingFace {
                    path,
                    tokenizer,
                    eod: Some(id),
                })
            }
        }
    }

    /// What the tokenizer is, for messages: `byte` or the file.
    pub fn describe(&self) -> String {
        match self {
            Tokenizer::Byte => "byte".to_string(),
            Tokenizer::HuggingFace { path, .. } => path.display().to_string(),
        }
    }

    /// The `tokenizer.json` the tokenizer was read from, as bytes (`None` for `byte`): what a
    /// checkpoint carries so that it does not depend on where training ran.
    pub fn file_bytes(&self) -> Result<Option<Vec<u8>>> {
        match self {
            Tokenizer::Byte => Ok(None),
            Tokenizer::HuggingFace { path, .. } => std::fs::read(path)
                .map(Some)
                .with_context(|| format!("reading the tokenizer {}", path.display())),
        }
    }

    /// Token ids of `text` (no special tokens added).
    pub fn encode(&self, text: &str) -> Result<Vec<u32>> {
        match self {
            Tokenizer::Byte => Ok(text.bytes().map(u32::from).collect()),
            Tokenizer::HuggingFace {
                path, tokenizer, ..
            } => {
                let encoding = tokenizer
                    .encode_fast(text, false)
                    .map_err(|e| anyhow!("{}: cannot encode: {e}", path.display()))?;
                Ok(encoding.get_ids().to_vec())
            }
        }
    }

    /// The text of token ids, special tokens included (the byte tokenizer shows its end of
    /// document as `<|endoftext|>` and broken UTF-8 as U+FFFD).
    pub fn decode(&self, ids: &[u32]) -> Result<String> {
        match self {
            Tokenizer::Byte => {
                let mut text = String::new();
                let mut bytes = Vec::new();
                for &id in ids {
                    match id {
                        0..=255 => bytes.push(id as u8),
                        BYTE_EOD => {
                            text.push_str(&String::from_utf8_lossy(&bytes));
                            bytes.clear();
                            text.push_str(ENDOFTEXT);
                        }
                        _ => bail!(
                            "token id {id} is outside the byte tokenizer's vocabulary of {}",
                            BYTE_EOD + 1
                        ),
                    }
                }
                text.push_str(&String::from_utf8_lossy(&bytes));
                Ok(text)
            }
            Tokenizer::HuggingFace {
                path, tokenizer, ..
            } => tokenizer
                .decode(ids, false)
                .map_err(|e| anyhow!("{}: cannot decode: {e}", path.display())),
        }
    }

    /// The id of token `token` (`None`: the tokenizer has no such token; the byte tokenizer
    /// knows only its end-of-document token by name).
    pub fn token_id(&self, token: &str) -> Option<u32> {
        match self {
            Tokenizer::Byte => (token == ENDOFTEXT).then_some(BYTE_EOD),
            Tokenizer::HuggingFace { tokenizer, .. } => tokenizer.token_to_id(token),
        }
    }

    /// The number of token ids (added tokens included, as Megatron-LM's `len(tokenizer)`).
    pub fn vocab_size(&self) -> usize {
        match self {
            Tokenizer::Byte => BYTE_EOD as usize + 1,
            Tokenizer::HuggingFace { tokenizer, .. } => tokenizer.get_vocab_size(true),
        }
    }

    /// The end-of-document id, if the tokenizer has one.
    pub fn eod(&self) -> Option<u32> {
        match self {
            Tokenizer::Byte => Some(BYTE_EOD),
            Tokenizer::HuggingFace { eod, .. } => *eod,
        }
    }

    /// The end-of-document id, or an error naming the tokenizer and the way out.
    pub fn require_eod(&self) -> Result<u32> {
        self.eod().with_context(|| {
            format!(
                "the tokenizer {} has no {ENDOFTEXT} token to end documents with; name its \
                 end-of-document token with --eod-token",
                self.describe()
            )
        })
    }
}

/// Text of tokens as they arrive, one piece at a time: each token's piece is the decoded text
/// of the tokens since the last piece, past what the earlier ones decoded to alone (so that a
/// tokenizer whose pieces depend on their neighbours, a leading space or bytes of one
/// character spread over tokens, gives the text `decode` gives of them all); a piece ending in
/// an unfinished character (U+FFFD) waits for the tokens that finish it.
#[derive(Debug, Default)]
pub struct TextStream {
    ids: Vec<u32>,
    /// The first token of the text decoded again with each new token.
    prefix: usize,
    /// The tokens whose text has been handed out.
    read: usize,
}

impl TextStream {
    /// An empty stream.
    pub fn new() -> Self {
        TextStream::default()
    }

    /// The text `id` adds (empty while a character is unfinished).
    pub fn push(&mut self, tokenizer: &Tokenizer, id: u32) -> Result<String> {
        self.ids.push(id);
        let before = tokenizer.decode(&self.ids[self.prefix..self.read])?;
        let now = tokenizer.decode(&self.ids[self.prefix..])?;
        if now.ends_with('\u{FFFD}') || now.len() <= before.len() {
            return Ok(String::new());
        }
        let Some(piece) = now.get(before.len()..) else {
            return Ok(String::new());
        };
        let piece = piece.to_string();
        self.prefix = self.read;
        self.read = self.ids.len();
        Ok(piece)
    }

    /// The text still held back (an unfinished character), once no token follows.
    pub fn finish(&mut self, tokenizer: &Tokenizer) -> Result<String> {
        let before = tokenizer.decode(&self.ids[self.prefix..self.read])?;
        let now = tokenizer.decode(&self.ids[self.prefix..])?;
        self.prefix = self.ids.len();
        self.read = self.ids.len();
        Ok(now.get(before.len()..).unwrap_or_default().to_string())
    }
}

/// The smallest vocabulary [`train_byte_level_bpe`] builds: the 256 byte symbols and
/// `<|endoftext|>`.
pub const MIN_BPE_VOCAB: usize = 257;

/// Trains a byte-level BPE tokenizer of GPT-2's kind (bytes as symbols, GPT-2's
/// pre-tokenization without a prefix space, `<|endoftext|>` as a special token) of at most
/// `vocab_size` tokens on `texts` (fewer when the texts have fewer pairs to merge). Returns its
/// `tokenizer.json`.
pub fn train_byte_level_bpe<I, S>(texts: I, vocab_size: usize) -> Result<String>
where
    I: Iterator<Item = S> + Send,
    S: AsRef<str> + Send,
{
    use tokenizers::models::bpe::{BPE, BpeTrainer};
    use tokenizers::normalizers::NormalizerWrapper;
    use tokenizers::pre_tokenizers::byte_level::ByteLevel;
    use tokenizers::{AddedToken, TokenizerBuilder};

    if vocab_size < MIN_BPE_VOCAB {
        bail!(
            "--vocab-size {vocab_size}: a byte-level BPE vocabulary of that many tokens cannot \
             hold the 256 byte symbols and {ENDOFTEXT}: give at least {MIN_BPE_VOCAB}"
        );
    }
    // GPT-2's: no space added before the first word, offsets trimmed, its split pattern.
    let byte_level = ByteLevel::new(false, true, true);
    let mut trainer = BpeTrainer::builder()
        .vocab_size(vocab_size)
        .min_frequency(0)
        .show_progress(false)
        .initial_alphabet(ByteLevel::alphabet().into_iter().collect())
        .special_tokens(vec![AddedToken::from(ENDOFTEXT, true)])
        .build();
    let mut tokenizer =
        TokenizerBuilder::<BPE, NormalizerWrapper, ByteLevel, ByteLevel, ByteLevel>::new()
            .with_model(BPE::default())
            .with_normalizer(None)
            .with_pre_tokenizer(Some(byte_level))
            .with_post_processor(Some(byte_level))
            .with_decoder(Some(byte_level))
            .build()
            .map_err(|e| anyhow!("building the tokenizer: {e}"))?;
    tokenizer
        .train(&mut trainer, texts)
        .map_err(|e| anyhow!("training the tokenizer: {e}"))?;
    tokenizer
        .to_string(true)
        .map_err(|e| anyhow!("writing the tokenizer as JSON: {e}"))
}

/// The tokenizer a checkpoint records, as a SPEC for [`Tokenizer::from_spec`]: `byte`, the
/// checkpoint's own copy of its `tokenizer.json`, or (checkpoints saved before they carried it)
/// the path they recorded. `None` when it records none.
pub fn checkpoint_tokenizer(ckpt: &Path) -> Result<Option<String>> {
    use megatron_core::checkpoint::{TOKENIZER_FILE, read_meta, resolve};
    let dir = resolve(ckpt)?;
    let meta = read_meta(&dir)?;
    if meta.files.contains_key(TOKENIZER_FILE) {
        return Ok(Some(dir.join(TOKENIZER_FILE).display().to_string()));
    }
    Ok(meta.run["tokenizer"].as_str().map(str::to_string))
}

/// What a checkpoint records as its tokenizer (`run.tokenizer`) and the files it carries for
/// it: `byte` and nothing, or [`TOKENIZER_FILE`](megatron_core::checkpoint::TOKENIZER_FILE)
/// and that file's bytes.
pub fn checkpoint_record(tokenizer: &Tokenizer) -> Result<(String, Files)> {
    use megatron_core::checkpoint::TOKENIZER_FILE;
    Ok(match tokenizer.file_bytes()? {
        None => ("byte".to_string(), Vec::new()),
        Some(bytes) => (
            TOKENIZER_FILE.to_string(),
            vec![(TOKENIZER_FILE.to_string(), bytes)],
        ),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn byte_tokenizer_round_trips() {
        let t = Tokenizer::from_spec("byte").unwrap();
        assert_eq!(t.vocab_size(), 257);
        assert_eq!(t.eod(), Some(256));
        let ids = t.encode("hé").unwrap();
        assert_eq!(ids, [104, 195, 169]);
        let mut with_eod = ids.clone();
        with_eod.push(256);
        assert_eq!(t.decode(&with_eod).unwrap(), "hé<|endoftext|>");
        assert!(t.decode(&[257]).is_err());
    }

    #[test]
    fn a_stream_hands_out_text_as_it_completes_and_all_of_it() {
        let t = Tokenizer::from_spec("byte").unwrap();
        let ids = t.encode("a é€!").unwrap();
        let mut stream = TextStream::new();
        let pieces: Vec<String> = ids.iter().map(|&id| stream.push(&t, id).unwrap()).collect();
        // The two bytes of é and the three of € wait for their last byte.
        assert_eq!(pieces, ["a", " ", "", "é", "", "", "€", "!"]);
        assert_eq!(stream.finish(&t).unwrap(), "");
        // An unfinished character at the end comes out as U+FFFD, as decode gives it.
        let mut stream = TextStream::new();
        assert_eq!(stream.push(&t, 0xE2).unwrap(), "");
        assert_eq!(stream.finish(&t).unwrap(), "\u{FFFD}");
        // A tokenizer whose pieces depend on their neighbours: the pieces join to decode's text.
        let spec = std::env::temp_dir().join(format!("stream-{}.json", std::process::id()));
        let texts = ["the cat sat on the mat", "a cat and a hat"];
        std::fs::write(&spec, train_byte_level_bpe(texts.iter(), 300).unwrap()).unwrap();
        let t = Tokenizer::from_file(&spec).unwrap();
        let ids = t.encode("the hat sat on a cat").unwrap();
        let mut stream = TextStream::new();
        let mut text = String::new();
        for &id in &ids {
            text.push_str(&stream.push(&t, id).unwrap());
        }
        text.push_str(&stream.finish(&t).unwrap());
        assert_eq!(text, t.decode(&ids).unwrap());
        std::fs::remove_file(&spec).ok();
    }

    #[test]
    fn a_missing_file_is_named() {
        let err = Tokenizer::from_spec("/nonexistent/tokenizer.json").unwrap_err();
        assert!(
            err.to_string().contains("/nonexistent/tokenizer.json"),
            "{err}"
        );
    }
}
