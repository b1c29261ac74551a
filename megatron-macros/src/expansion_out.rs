//! A user's own expansion, on stable Rust with the build they already run: when the
//! environment variable `MEGATRON_EXPAND_DIR` names a directory at build time, each
//! `#[megatron::module]` writes what it generated, formatted by `prettyplease`, to
//! `$MEGATRON_EXPAND_DIR/<crate>/<Module>.rs`: the struct's items (the struct, its spec,
//! `impl Module`) and, once the impl is expanded, the impl's (the `Saved` struct, `forward`,
//! `backward` with every collective). `cargo expand` (nightly) shows the same code in place.
//!
//! The struct's expansion reads the variable with `option_env!` ([`TRACK`]), so rustc records
//! it among the crate's inputs and cargo rebuilds the crate when it is set, changed or unset:
//! setting it is all a user does.

use std::path::{Path, PathBuf};

use proc_macro2::TokenStream;
use quote::quote;

/// The environment variable naming the directory.
pub const VAR: &str = "MEGATRON_EXPAND_DIR";

/// The item that makes rustc track [`VAR`] for the crate (its value is not used).
pub fn track() -> TokenStream {
    quote! {
        // Read so that cargo rebuilds this crate when MEGATRON_EXPAND_DIR changes: with it set,
        // `#[megatron::module]` writes each module's expansion into that directory.
        const _: ::core::option::Option<&str> = ::core::option_env!("MEGATRON_EXPAND_DIR");
    }
}

/// Writes `items` (a module's expansion) as `<dir>/<crate>/<module>.rs` when [`VAR`] is set;
/// a compile error naming the path when it cannot be written, nothing otherwise.
pub fn write_if_asked(module: &str, items: &TokenStream) -> TokenStream {
    let Some(dir) = std::env::var_os(VAR).filter(|d| !d.is_empty()) else {
        return TokenStream::new();
    };
    let krate = std::env::var("CARGO_CRATE_NAME").unwrap_or_else(|_| "crate".to_string());
    match write(Path::new(&dir), &krate, module, items) {
        Ok(_) => TokenStream::new(),
        Err(message) => {
            let message = format!("{VAR}: {message}");
            quote!(::core::compile_error!(#message);)
        }
    }
}

/// Writes `items` formatted to `dir/krate/module.rs` (through a temporary file renamed into
/// place, so a reader never sees half a file); returns the path, or why not.
pub fn write(
    dir: &Path,
    krate: &str,
    module: &str,
    items: &TokenStream,
) -> Result<PathBuf, String> {
    let file: syn::File = syn::parse2(items.clone())
        .map_err(|e| format!("the expansion of `{module}` does not parse: {e}"))?;
    let text = format!(
        "// The expansion of `#[megatron::module]` on `{module}` (crate `{krate}`),\n// written \
         by megatron-macros because {VAR} is set; `cargo expand` shows the same\n// code in \
         place.\n\n{}",
        prettyplease::unparse(&file)
    );
    let folder = dir.join(krate);
    std::fs::create_dir_all(&folder)
        .map_err(|e| format!("cannot create {}: {e}", folder.display()))?;
    let path = folder.join(format!("{module}.rs"));
    let tmp = folder.join(format!(".{module}.rs.tmp-{}", std::process::id()));
    std::fs::write(&tmp, text).map_err(|e| format!("cannot write {}: {e}", tmp.display()))?;
    std::fs::rename(&tmp, &path).map_err(|e| {
        let _ = std::fs::remove_file(&tmp);
        format!("cannot write {}: {e}", path.display())
    })?;
    Ok(path)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_expansion_is_written_formatted_and_a_bad_directory_named() {
        let dir = std::env::temp_dir().join(format!("megatron-expand-{}", std::process::id()));
        let items = quote! {
            pub struct Mlp { fc1: Linear }
            impl Mlp { pub fn forward(&self) -> u32 { let y = 1; y } }
        };
        let path = write(&dir, "my_model", "Mlp", &items).unwrap();
        assert_eq!(path, dir.join("my_model").join("Mlp.rs"));
        let text = std::fs::read_to_string(&path).unwrap();
        assert!(text.starts_with("// The expansion of `#[megatron::module]` on `Mlp`"));
        assert!(
            text.contains("pub struct Mlp {\n    fc1: Linear,\n}"),
            "{text}"
        );
        assert!(text.contains("        let y = 1;\n"), "{text}");
        // A file where the directory should be: the error names it.
        let blocked = dir.join("blocked");
        std::fs::write(&blocked, "").unwrap();
        let err = write(&blocked, "my_model", "Mlp", &items).unwrap_err();
        assert!(err.contains("cannot create"), "{err}");
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
