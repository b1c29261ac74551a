//! TensorBoard event files against the TFRecord/Event specification, read back by an independent
//! parser; the loss plot as a PNG.

use megatron::report::plot::{Curves, Point, draw};
use megatron::report::tensorboard::EventWriter;

/// CRC-32C (Castagnoli), bit by bit: independent of the crate the writer uses.
fn crc32c_bitwise(data: &[u8]) -> u32 {
    let mut crc = !0u32;
    for &b in data {
        crc ^= u32::from(b);
        for _ in 0..8 {
            crc = if crc & 1 == 1 {
                (crc >> 1) ^ 0x82F6_3B78
            } else {
                crc >> 1
            };
        }
    }
    !crc
}

fn masked(data: &[u8]) -> u32 {
    crc32c_bitwise(data)
        .rotate_right(15)
        .wrapping_add(0xa282_ead8)
}

fn varint(buf: &[u8], pos: &mut usize) -> u64 {
    let mut v = 0u64;
    let mut shift = 0;
    loop {
        let b = buf[*pos];
        *pos += 1;
        v |= u64::from(b & 0x7f) << shift;
        if b & 0x80 == 0 {
            return v;
        }
        shift += 7;
    }
}

/// Protobuf fields of a message: (field, wire type, payload bytes).
fn fields(buf: &[u8]) -> Vec<(u64, u64, Vec<u8>)> {
    let mut pos = 0;
    let mut out = Vec::new();
    while pos < buf.len() {
        let k = varint(buf, &mut pos);
        let (field, wire) = (k >> 3, k & 7);
        let payload = match wire {
            0 => {
                let start = pos;
                varint(buf, &mut pos);
                buf[start..pos].to_vec()
            }
            1 => {
                pos += 8;
                buf[pos - 8..pos].to_vec()
            }
            2 => {
                let n = varint(buf, &mut pos) as usize;
                pos += n;
                buf[pos - n..pos].to_vec()
            }
            5 => {
                pos += 4;
                buf[pos - 4..pos].to_vec()
            }
            other => panic!("wire type {other}"),
        };
        out.push((field, wire, payload));
    }
    out
}

#[test]
fn tensorboard_records_follow_the_format() {
    let dir = std::env::temp_dir().join(format!("megatron-tb-{}", std::process::id()));
    let mut w = EventWriter::create(&dir).unwrap();
    w.scalar("lm loss", 3, 2.5).unwrap();
    w.scalar("validation loss", 10, 1.25).unwrap();
    w.flush().unwrap();
    let bytes = std::fs::read(w.path()).unwrap();
    assert!(
        w.path()
            .file_name()
            .unwrap()
            .to_string_lossy()
            .starts_with("events.out.tfevents.")
    );
    let mut pos = 0;
    let mut events = Vec::new();
    while pos < bytes.len() {
        let len_bytes = &bytes[pos..pos + 8];
        let len = u64::from_le_bytes(len_bytes.try_into().unwrap()) as usize;
        assert_eq!(
            u32::from_le_bytes(bytes[pos + 8..pos + 12].try_into().unwrap()),
            masked(len_bytes)
        );
        let data = &bytes[pos + 12..pos + 12 + len];
        assert_eq!(
            u32::from_le_bytes(bytes[pos + 12 + len..pos + 16 + len].try_into().unwrap()),
            masked(data)
        );
        events.push(fields(data));
        pos += 16 + len;
    }
    assert_eq!(events.len(), 3);
    assert!(
        events[0]
            .iter()
            .any(|(f, _, p)| *f == 3 && p == b"brain.Event:2")
    );
    let scalar = |e: &[(u64, u64, Vec<u8>)]| -> (u64, String, f32) {
        let step = e
            .iter()
            .find(|(f, _, _)| *f == 2)
            .map(|(_, _, p)| varint(p, &mut 0))
            .unwrap();
        let summary = &e.iter().find(|(f, w, _)| *f == 5 && *w == 2).unwrap().2;
        let value = &fields(summary)[0].2;
        let vf = fields(value);
        let tag =
            String::from_utf8(vf.iter().find(|(f, _, _)| *f == 1).unwrap().2.clone()).unwrap();
        let x = f32::from_le_bytes(
            vf.iter()
                .find(|(f, w, _)| *f == 2 && *w == 5)
                .unwrap()
                .2
                .clone()
                .try_into()
                .unwrap(),
        );
        (step, tag, x)
    };
    assert_eq!(scalar(&events[1]), (3, "lm loss".to_string(), 2.5));
    assert_eq!(
        scalar(&events[2]),
        (10, "validation loss".to_string(), 1.25)
    );
    std::fs::remove_dir_all(&dir).ok();
}

#[test]
fn the_loss_plot_is_a_png_from_the_log() {
    let log = "{\"step\":0,\"tokens\":512,\"loss\":5.5}\n{\"step\":1,\"tokens\":1024,\"loss\":4.0}\n\n{\"step\":1,\"tokens\":1024,\"valid_loss\":4.4}\n";
    let curves = Curves::from_log(log).unwrap();
    assert_eq!(
        curves.train,
        vec![
            Point {
                tokens: 512.0,
                loss: 5.5
            },
            Point {
                tokens: 1024.0,
                loss: 4.0
            }
        ]
    );
    assert_eq!(
        curves.valid,
        vec![Point {
            tokens: 1024.0,
            loss: 4.4
        }]
    );
    let path = std::env::temp_dir().join(format!("megatron-plot-{}.png", std::process::id()));
    draw(&curves, "gpt-tiny", &path).unwrap();
    let png = std::fs::read(&path).unwrap();
    assert_eq!(&png[..8], b"\x89PNG\r\n\x1a\n");
    assert_eq!(&png[12..16], b"IHDR");
    assert_eq!(u32::from_be_bytes(png[16..20].try_into().unwrap()), 960);
    assert_eq!(u32::from_be_bytes(png[20..24].try_into().unwrap()), 540);
    // The title is drawn (the font is embedded, no system font is looked up): the caption's band
    // above the chart holds dark pixels, and only text is drawn there.
    let image = image::load_from_memory(&png).unwrap().to_rgb8();
    let dark = (0..30)
        .flat_map(|y| (300..660).map(move |x| (x, y)))
        .filter(|&(x, y)| image.get_pixel(x, y).0.iter().all(|&c| c < 128))
        .count();
    assert!(dark > 20, "{dark} dark pixels where the title should be");
    std::fs::remove_file(&path).ok();
    assert!(
        Curves::from_log("{\"loss\": 1}")
            .unwrap_err()
            .to_string()
            .contains("no `tokens`")
    );
}
