//! `metrics.png` carries text: the figure's title, each panel's title, axis labels and tick
//! values (dark pixels where a textless plot has only background), drawn from synthetic
//! metrics lines, including panels without data.

use serde_json::{json, Value};

/// The decoded RGB(A) pixels of a PNG file: (width, height, channels, bytes).
fn decode(path: &std::path::Path) -> (usize, usize, usize, Vec<u8>) {
    let decoder = png::Decoder::new(std::fs::File::open(path).unwrap());
    let mut reader = decoder.read_info().unwrap();
    let mut buf = vec![0; reader.output_buffer_size()];
    let info = reader.next_frame(&mut buf).unwrap();
    buf.truncate(info.buffer_size());
    (info.width as usize, info.height as usize, info.color_type.samples(), buf)
}

/// Dark pixels (all channels below 100) in the rectangle `[x0, x1) × [y0, y1)`.
fn dark(img: &(usize, usize, usize, Vec<u8>), (x0, x1): (usize, usize), (y0, y1): (usize, usize)) -> usize {
    let (w, _, c, px) = img;
    let mut n = 0;
    for y in y0..y1 {
        for x in x0..x1 {
            let p = &px[(y * w + x) * c..(y * w + x) * c + 3];
            n += p.iter().all(|&v| v < 100) as usize;
        }
    }
    n
}

fn lines(steps: u64) -> Vec<Value> {
    let mut out: Vec<Value> = (1..=steps)
        .map(|s| {
            let x = s as f64;
            json!({"kind": "train", "step": s, "reward": 0.2 + 0.05 * x, "entropy": 2.0 - 0.1 * x,
                   "kl_to_initial": 0.001 * x * x, "completion_length_drift": 1.0 + 0.02 * x,
                   "train_eval_reward_gap": if s % 4 == 0 { json!(0.05 * x - 0.1) } else { Value::Null }})
        })
        .collect();
    out.extend((1..=steps / 4).map(|k| json!({"kind": "eval", "step": 4 * k, "eval_reward": 0.1 + 0.05 * k as f64})));
    out
}

#[test]
fn metrics_png_has_titles_axis_labels_and_ticks() {
    let dir = tests::temp_dir("plot-text");
    let path = dir.join("metrics.png");
    rl::plot::write_png(&path, &lines(20)).unwrap();
    let img = decode(&path);
    let (w, h) = (img.0, img.1);
    assert_eq!((w as u32, h as u32), rl::plot::SIZE);
    // The figure title band (above the first panel) holds text.
    assert!(dark(&img, (0, w), (0, 60)) > 500, "figure title");
    let panel = (h - 60) / 5;
    for k in 0..5 {
        let top = 60 + k * panel;
        // Panel title: a band at the panel's top, centred.
        assert!(dark(&img, (w / 4, 3 * w / 4), (top, top + 35)) > 150, "panel {k}: title");
        // Y tick values and label: the left margin.
        assert!(dark(&img, (0, 80), (top + 40, top + panel - 50)) > 150, "panel {k}: y ticks and label");
        // X tick values and the "training step" label: the band under the plot.
        assert!(dark(&img, (100, w - 30), (top + panel - 45, top + panel - 5)) > 200, "panel {k}: x ticks and label");
    }
    // Empty metrics draw the same frame with "no data yet".
    let empty = dir.join("empty.png");
    rl::plot::write_png(&empty, &[]).unwrap();
    let img = decode(&empty);
    assert!(dark(&img, (0, w), (0, 60)) > 500);
}
