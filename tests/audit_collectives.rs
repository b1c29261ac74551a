//! docs/collectives.md is the audit of one training step recorded now (`megatron::audit`): a
//! change that adds, removes, moves or resizes a collective changes the document, and this test
//! fails until it is regenerated (`MEGATRON_BLESS=1 cargo test --test audit_collectives`).

use megatron::audit::{AuditLayout, document, job, record_step};

const DOCUMENT: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/docs/collectives.md");

#[test]
fn the_collectives_document_is_a_recorded_step() {
    let layout = AuditLayout::default();
    let ranks = record_step(&job(&layout).expect("the audited job")).expect("one recorded step");
    assert_eq!(ranks.len(), 8, "tp 2 · pp 2 · dp 2 ranks");
    // Every rank of a stage makes the same calls as the stage's first rank (on its own groups).
    for (rank, calls) in ranks.iter().enumerate() {
        let first = &ranks[rank / 4 * 4];
        let kinds = |c: &[megatron::comm::recording::Call]| -> Vec<(String, String)> {
            c.iter()
                .map(|c| (c.group.clone(), c.desc.kind.to_string()))
                .collect()
        };
        assert_eq!(kinds(calls), kinds(first), "rank {rank}'s calls");
    }
    let fresh = document(&layout, &ranks);
    if std::env::var_os("MEGATRON_BLESS").is_some() {
        std::fs::write(DOCUMENT, &fresh).expect("writing docs/collectives.md");
        return;
    }
    let committed = std::fs::read_to_string(DOCUMENT).unwrap_or_default();
    assert!(
        committed == fresh,
        "docs/collectives.md differs from the step recorded now: regenerate it with \
         `MEGATRON_BLESS=1 cargo test --test audit_collectives` and commit it"
    );
}

#[test]
fn a_layout_that_cannot_run_is_an_error_naming_it() {
    let zero = AuditLayout {
        dp: 0,
        ..AuditLayout::default()
    };
    let Err(err) = job(&zero) else {
        panic!("dp 0 is refused")
    };
    let err = err.to_string();
    assert!(err.contains("at least 1") && err.contains("dp 0"), "{err}");
    // The expert groups (etp · ep · pp = 6 ranks) do not divide the world of 8.
    let uneven = AuditLayout {
        ep: 3,
        ..AuditLayout::default()
    };
    let Err(err) = job(&uneven).and_then(|j| record_step(&j)) else {
        panic!("ep 3 is refused")
    };
    let err = err.to_string();
    assert!(
        err.contains("not divisible") && err.contains("1·3·2"),
        "{err}"
    );
}
