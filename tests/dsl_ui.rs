//! Compile errors of `#[megatron::module]`: each file under `tests/ui/` must fail to compile
//! with exactly the messages of its `.stderr` file (`TRYBUILD=overwrite` regenerates them).

#[test]
fn module_misuse_is_a_compile_error_with_a_span() {
    let t = trybuild::TestCases::new();
    t.compile_fail("tests/ui/*.rs");
}
