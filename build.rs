//! Collects the project's own sources and documentation into one text file: the default training
//! corpus of `megatron train`, so the main job needs no download.

use std::fs;
use std::path::{Path, PathBuf};

fn collect(dir: &Path, out: &mut Vec<PathBuf>) {
    let Ok(entries) = fs::read_dir(dir) else {
        return;
    };
    for entry in entries.flatten() {
        let path = entry.path();
        if path.is_dir() {
            collect(&path, out);
        } else if matches!(path.extension().and_then(|e| e.to_str()), Some("rs" | "md")) {
            out.push(path);
        }
    }
}

fn main() {
    let root =
        PathBuf::from(std::env::var("CARGO_MANIFEST_DIR").expect("cargo sets CARGO_MANIFEST_DIR"));
    let mut files = Vec::new();
    for dir in [
        "src",
        "megatron-core/src",
        "megatron-models/src",
        "megatron-macros/src",
        "docs",
    ] {
        collect(&root.join(dir), &mut files);
        println!("cargo:rerun-if-changed={dir}");
    }
    for doc in ["README.md", "BENCHMARKS.md"] {
        files.push(root.join(doc));
        println!("cargo:rerun-if-changed={doc}");
    }
    files.sort();
    let mut corpus = String::new();
    for file in files {
        if let Ok(text) = fs::read_to_string(&file) {
            corpus.push_str(&text);
            corpus.push('\n');
        }
    }
    let out =
        PathBuf::from(std::env::var("OUT_DIR").expect("cargo sets OUT_DIR")).join("corpus.txt");
    fs::write(out, corpus).expect("writing the corpus into OUT_DIR");
}
