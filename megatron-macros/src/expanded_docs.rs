//! docs/expanded-*.md are generated: every Rust block of theirs preceded by a marker
//!
//! ```text
//! <!-- expand: SOURCE | ITEM [| fn NAME, ..] [| lines FROM .. TO [; FROM .. TO]] -->
//! ```
//!
//! is the macros' expansion of the `#[module]` items of `SOURCE` (a path from the workspace's
//! root), printed by `prettyplease`: the item whose first line (after its attributes and doc
//! comments) starts with `ITEM`, or, with `source NAME`, module `NAME`'s struct and impl as the
//! user wrote them. `fn A, B` keeps those functions of the impls that start with `ITEM`;
//! `lines` keeps the runs of lines from one containing `FROM` to the next containing `TO` (`TO
//! +n`: and n lines more), with `// ...` where lines are left out. Consecutive markers fill
//! one block, their parts one after the other.
//!
//! [`the_expansion_documents_are_the_macros_output`] regenerates every marked block and fails
//! when a committed document differs; `MEGATRON_BLESS=1` writes them instead.

use std::path::{Path, PathBuf};

use quote::{ToTokens, quote};

use crate::root::Root;

/// The documents generated from the macros.
const DOCUMENTS: [&str; 14] = [
    "docs/expanded-parallel-block.md",
    "docs/expanded-elementwise.md",
    "docs/expanded-mlp.md",
    "docs/expanded-llama.md",
    "docs/expanded-moe.md",
    "docs/expanded-pipeline.md",
    "docs/expanded-recompute.md",
    "docs/expanded-graph-scope.md",
    "docs/expanded-context-parallel.md",
    "docs/expanded-several-outputs.md",
    "docs/expanded-lora.md",
    "docs/expanded-mla.md",
    "docs/expanded-loop-body.md",
    "docs/expanded-sharded-params.md",
];

/// What a marker starts with.
const MARKER: &str = "<!-- expand:";

fn workspace() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("megatron-macros sits in the workspace")
        .to_path_buf()
}

/// Whether an item carries `#[module]` or `#[megatron::module]`.
fn is_module(attrs: &[syn::Attribute]) -> bool {
    attrs.iter().any(|a| {
        a.path()
            .segments
            .last()
            .is_some_and(|s| s.ident == "module")
    })
}

/// The paths a file's expansion uses: the facade's, or (megatron-models) the crates'.
fn root_for(source: &str) -> Root {
    if source.starts_with("megatron-models/") {
        Root {
            runtime: quote!(::megatron_core),
            macros: quote!(::megatron_macros),
        }
    } else {
        Root {
            runtime: quote!(::megatron),
            macros: quote!(::megatron),
        }
    }
}

/// A source file's `#[module]` items as written, and their expansion.
struct Expansion {
    written: Vec<syn::Item>,
    expanded: Vec<syn::Item>,
}

/// Expands the `#[module]` structs of `items` (and inline modules), each with its impl.
fn expand_items(root: &Root, items: &[syn::Item], out: &mut Expansion) {
    for item in items {
        match item {
            syn::Item::Mod(m) => {
                if let Some((_, inner)) = &m.content {
                    expand_items(root, inner, out);
                }
            }
            syn::Item::Struct(s) if is_module(&s.attrs) => {
                let mut bare = s.clone();
                bare.attrs.retain(|a| !is_module(std::slice::from_ref(a)));
                let original = bare.to_token_stream();
                out.written.push(item.clone());
                let mut tokens = crate::expand_struct(root, bare.clone(), &original);
                let imp = items.iter().find_map(|i| match i {
                    syn::Item::Impl(imp)
                        if is_module(&imp.attrs)
                            && s.ident == imp.self_ty.to_token_stream().to_string() =>
                    {
                        Some(imp)
                    }
                    _ => None,
                });
                if let Some(imp) = imp {
                    out.written.push(syn::Item::Impl(imp.clone()));
                    let mut bare_impl = imp.clone();
                    bare_impl
                        .attrs
                        .retain(|a| !is_module(std::slice::from_ref(a)));
                    tokens.extend(crate::module_impl(root, quote!(#bare ; #bare_impl)));
                }
                let file: syn::File = syn::parse2(tokens)
                    .unwrap_or_else(|e| panic!("the expansion of {} parses: {e}", s.ident));
                out.expanded.extend(file.items);
            }
            _ => {}
        }
    }
}

fn expand_file(source: &str) -> Expansion {
    let path = workspace().join(source);
    let text = std::fs::read_to_string(&path)
        .unwrap_or_else(|e| panic!("reading {}: {e}", path.display()));
    let file = syn::parse_file(&text).unwrap_or_else(|e| panic!("parsing {source}: {e}"));
    let mut out = Expansion {
        written: Vec::new(),
        expanded: Vec::new(),
    };
    expand_items(&root_for(source), &file.items, &mut out);
    out
}

/// An item as `prettyplease` prints it.
fn print(item: &syn::Item) -> String {
    prettyplease::unparse(&syn::File {
        shebang: None,
        attrs: Vec::new(),
        items: vec![item.clone()],
    })
}

/// The first line of printed code that is not an attribute or a doc comment.
fn head(printed: &str) -> &str {
    printed
        .lines()
        .map(str::trim_start)
        .find(|l| !l.starts_with("#[") && !l.starts_with("///") && !l.is_empty())
        .unwrap_or("")
}

/// What a marker asks for.
struct Request {
    source: String,
    item: String,
    function: Option<String>,
    ranges: Vec<(String, String)>,
}

fn parse_marker(line: &str) -> Request {
    let body = line
        .trim()
        .strip_prefix(MARKER)
        .and_then(|l| l.strip_suffix("-->"))
        .unwrap_or_else(|| panic!("a marker is one line `{MARKER} .. -->`: {line}"));
    let mut parts = body.split(" | ").map(str::trim);
    let source = parts.next().unwrap_or_default().to_string();
    let item = parts
        .next()
        .unwrap_or_else(|| panic!("the marker names no item: {line}"))
        .to_string();
    let mut request = Request {
        source,
        item,
        function: None,
        ranges: Vec::new(),
    };
    for part in parts {
        if let Some(name) = part.strip_prefix("fn ") {
            request.function = Some(name.trim().to_string());
        } else if let Some(ranges) = part.strip_prefix("lines ") {
            for range in ranges.split(" ; ") {
                let (from, to) = range
                    .split_once(" .. ")
                    .unwrap_or_else(|| panic!("a range is `FROM .. TO`: {line}"));
                request
                    .ranges
                    .push((from.trim().to_string(), to.trim().to_string()));
            }
        } else {
            panic!("unknown marker part {part:?}: {line}");
        }
    }
    request
}

/// The functions `names` (comma-separated) of the impls in `pool` whose head starts with
/// `wanted`, in one impl block with the first one's header.
fn functions(pool: &[syn::Item], wanted: &str, names: &str) -> syn::Item {
    let impls: Vec<&syn::ItemImpl> = pool
        .iter()
        .filter(|i| head(&print(i)).starts_with(wanted))
        .filter_map(|i| match i {
            syn::Item::Impl(imp) => Some(imp),
            _ => None,
        })
        .collect();
    let mut block = (*impls
        .first()
        .unwrap_or_else(|| panic!("no impl starts with {wanted:?}")))
    .clone();
    block.items = names
        .split(',')
        .map(str::trim)
        .map(|name| {
            impls
                .iter()
                .flat_map(|imp| &imp.items)
                .find(|i| matches!(i, syn::ImplItem::Fn(f) if f.sig.ident == name))
                .unwrap_or_else(|| panic!("no `fn {name}` in `{wanted}`"))
                .clone()
        })
        .collect();
    syn::Item::Impl(block)
}

/// The runs of `text`'s lines from a line containing `from` to the next containing `to`,
/// dedented together, with `// ...` where lines are left out.
fn excerpt(text: &str, ranges: &[(String, String)]) -> String {
    let lines: Vec<&str> = text.lines().collect();
    // Each run, and whether lines were left out before it.
    let mut runs: Vec<(bool, &[&str])> = Vec::new();
    let mut at = 0;
    for (from, to) in ranges {
        let start = (at..lines.len())
            .find(|&i| lines[i].contains(from.as_str()))
            .unwrap_or_else(|| panic!("no line contains {from:?} after line {at}:\n{text}"));
        // `TO +n`: n lines after the one containing TO.
        let (to, more) = match to.rsplit_once(" +") {
            Some((t, n)) if n.parse::<usize>().is_ok() => (t, n.parse().unwrap_or(0)),
            _ => (to.as_str(), 0),
        };
        let end = (start..lines.len())
            .find(|&i| lines[i].contains(to))
            .map(|i| (i + more).min(lines.len() - 1))
            .unwrap_or_else(|| panic!("no line contains {to:?} after {from:?}:\n{text}"));
        runs.push((start > at, &lines[start..=end]));
        at = end + 1;
    }
    let indent = runs
        .iter()
        .flat_map(|(_, r)| r.iter())
        .filter(|l| !l.trim().is_empty())
        .map(|l| l.len() - l.trim_start().len())
        .min()
        .unwrap_or(0);
    let mut kept = String::new();
    for (gap, run) in &runs {
        if *gap {
            kept.push_str("// ...\n");
        }
        for line in *run {
            kept.push_str(line.get(indent..).unwrap_or(line.trim_start()));
            kept.push('\n');
        }
    }
    if at < lines.len() {
        kept.push_str("// ...\n");
    }
    kept
}

/// The block a marker asks for.
fn generate(request: &Request, files: &mut Vec<(String, Expansion)>) -> String {
    if !files.iter().any(|(s, _)| *s == request.source) {
        let expansion = expand_file(&request.source);
        files.push((request.source.clone(), expansion));
    }
    let (_, expansion) = files
        .iter()
        .find(|(s, _)| *s == request.source)
        .expect("expanded above");
    if let Some(name) = request.item.strip_prefix("source ") {
        let written: Vec<String> = expansion
            .written
            .iter()
            .filter(|i| match i {
                syn::Item::Struct(s) => s.ident == name,
                syn::Item::Impl(imp) => imp.self_ty.to_token_stream().to_string() == name,
                _ => false,
            })
            .map(print)
            .collect();
        assert!(!written.is_empty(), "{}: no module {name}", request.source);
        return written.join("\n");
    }
    let (pool, wanted) = (&expansion.expanded, request.item.as_str());
    if let Some(names) = &request.function {
        let text = print(&functions(pool, wanted, names));
        return match request.ranges.is_empty() {
            true => text,
            false => excerpt(&text, &request.ranges),
        };
    }
    let item = pool
        .iter()
        .find(|i| head(&print(i)).starts_with(wanted))
        .unwrap_or_else(|| {
            let heads: Vec<String> = pool.iter().map(|i| head(&print(i)).to_string()).collect();
            panic!(
                "{}: no item starts with {wanted:?}; the items are:\n{}",
                request.source,
                heads.join("\n")
            )
        });
    let text = print(item);
    if request.ranges.is_empty() {
        text
    } else {
        excerpt(&text, &request.ranges)
    }
}

/// The document with every marked block regenerated (consecutive markers: their parts one after
/// the other in the block that follows them).
fn regenerate(document: &str, files: &mut Vec<(String, Expansion)>) -> String {
    let mut out = String::new();
    let mut requests = Vec::new();
    let mut lines = document.lines();
    while let Some(line) = lines.next() {
        out.push_str(line);
        out.push('\n');
        if line.trim_start().starts_with(MARKER) {
            requests.push(parse_marker(line));
            continue;
        }
        if requests.is_empty() {
            continue;
        }
        assert_eq!(line, "```rust", "markers are followed by a Rust block");
        for old in lines.by_ref() {
            if old == "```" {
                break;
            }
        }
        let parts: Vec<String> = requests.drain(..).map(|r| generate(&r, files)).collect();
        out.push_str(&parts.join("\n"));
        out.push_str("```\n");
    }
    out
}

#[test]
fn the_expansion_documents_are_the_macros_output() {
    let bless = std::env::var_os("MEGATRON_BLESS").is_some();
    let mut files = Vec::new();
    let mut stale = Vec::new();
    for doc in DOCUMENTS {
        let path = workspace().join(doc);
        let committed =
            std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("reading {doc}: {e}"));
        assert!(committed.contains(MARKER), "{doc} has no generated block");
        let fresh = regenerate(&committed, &mut files);
        if fresh != committed {
            if bless {
                std::fs::write(&path, fresh).unwrap_or_else(|e| panic!("writing {doc}: {e}"));
            } else {
                stale.push(doc);
            }
        }
    }
    assert!(
        stale.is_empty(),
        "{stale:?} differ from what the macros generate now: regenerate them with \
         `MEGATRON_BLESS=1 cargo test -p megatron-macros expansion_documents` and commit them"
    );
}

#[test]
fn an_excerpt_keeps_its_runs_and_marks_the_gaps() {
    let text = "fn f() {\n    let a = 1;\n    let b = 2;\n    let c = 3;\n}\n";
    let kept = excerpt(text, &[("let b".to_string(), "let b".to_string())]);
    assert_eq!(kept, "// ...\nlet b = 2;\n// ...\n");
    let whole = excerpt(text, &[("fn f".to_string(), "}".to_string())]);
    assert_eq!(whole, text);
}

#[test]
fn a_marker_names_its_source_item_function_and_lines() {
    let r = parse_marker(
        "<!-- expand: megatron-models/src/gpt.rs | impl Block | fn forward | lines a .. b ; c .. d -->",
    );
    assert_eq!(r.source, "megatron-models/src/gpt.rs");
    assert_eq!(r.item, "impl Block");
    assert_eq!(r.function.as_deref(), Some("forward"));
    assert_eq!(
        r.ranges,
        [("a".into(), "b".into()), ("c".into(), "d".into())]
    );
}
