//! Training data: Megatron-LM's indexed datasets, GPT samples and blends (re-exported from
//! megatron-core), and what the command line can use without downloads.

pub use megatron_core::data::*;

/// The project's own sources and documentation as text, collected at build time: the default
/// corpus of `megatron train` (with the byte-level tokenizer).
pub fn default_corpus() -> &'static [u8] {
    include_bytes!(concat!(env!("OUT_DIR"), "/corpus.txt"))
}

/// `f` of every item on `workers` threads (contiguous shares, one a thread), in input order;
/// the first error wins. Tokenizing uses it (`megatron preprocess`, chat data).
pub fn in_parallel<T: Sync, U: Send>(
    items: &[T],
    workers: usize,
    f: impl Fn(&T) -> anyhow::Result<U> + Sync,
) -> anyhow::Result<Vec<U>> {
    use anyhow::Context as _;
    if workers <= 1 || items.len() < 2 {
        return items.iter().map(&f).collect();
    }
    let chunk = items.len().div_ceil(workers);
    let f = &f;
    let parts: Vec<anyhow::Result<Vec<U>>> = std::thread::scope(|s| {
        let handles: Vec<_> = items
            .chunks(chunk)
            .enumerate()
            .map(|(i, part)| {
                std::thread::Builder::new()
                    .spawn_scoped(s, move || part.iter().map(f).collect())
                    .with_context(|| {
                        format!(
                            "{workers} workers: the operating system refused tokenizing thread {i}"
                        )
                    })
            })
            .collect();
        handles
            .into_iter()
            .map(|h| {
                h.and_then(|h| {
                    h.join()
                        .map_err(|_| anyhow::anyhow!("a tokenizing thread panicked"))?
                })
            })
            .collect()
    });
    let mut out = Vec::with_capacity(items.len());
    for part in parts {
        out.extend(part?);
    }
    Ok(out)
}
