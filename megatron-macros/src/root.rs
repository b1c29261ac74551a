//! Where the generated code finds the runtime and the macros.

use proc_macro_crate::{FoundCrate, crate_name};
use proc_macro2::{Span, TokenStream};
use quote::quote;

/// The paths generated code uses.
pub struct Root {
    /// The runtime: `::megatron` (the facade re-exports megatron-core) or `::megatron_core`.
    pub runtime: TokenStream,
    /// Where `__module_impl!` lives: `::megatron` or `::megatron_macros`.
    pub macros: TokenStream,
}

fn path(name: &str) -> TokenStream {
    let ident = syn::Ident::new(name, Span::call_site());
    quote!(::#ident)
}

impl Root {
    /// Finds the roots from the calling crate's manifest: the facade `megatron` if it depends on
    /// it (or is it: `::megatron` in its tests, examples and binary, `crate` in its library),
    /// else `megatron-core` and `megatron-macros` (as `megatron-models` does), under whatever
    /// names the manifest gives them.
    pub fn find() -> Root {
        match crate_name("megatron") {
            // The facade's own library (not its binary, tests or examples) names itself `crate`.
            Ok(FoundCrate::Itself) if compiling_the_library("megatron") => Root {
                runtime: quote!(crate),
                macros: quote!(crate),
            },
            Ok(FoundCrate::Itself) => Root {
                runtime: path("megatron"),
                macros: path("megatron"),
            },
            Ok(FoundCrate::Name(name)) => Root {
                runtime: path(&name),
                macros: path(&name),
            },
            Err(_) => {
                let runtime = match crate_name("megatron-core") {
                    Ok(FoundCrate::Name(name)) => path(&name),
                    Ok(FoundCrate::Itself) => quote!(crate),
                    Err(_) => path("megatron"),
                };
                let macros = match crate_name("megatron-macros") {
                    Ok(FoundCrate::Name(name)) => path(&name),
                    Ok(FoundCrate::Itself) | Err(_) => path("megatron_macros"),
                };
                Root { runtime, macros }
            }
        }
    }
}

/// Whether rustc is compiling the library target of package `name` (cargo tells the crate and,
/// for binaries, the binary's name in the environment of the compiler, which macros share).
fn compiling_the_library(name: &str) -> bool {
    std::env::var("CARGO_CRATE_NAME").is_ok_and(|c| c == name)
        && std::env::var_os("CARGO_BIN_NAME").is_none()
}
