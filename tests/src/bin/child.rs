//! The server process of the crash tests (`tests/integration/durability.rs`): the server
//! library of `rlserve serve --learn-from-feedback` on a model folder, feedback ratings
//! trained two at a time with a checkpoint after every step. It prints the line `rlserve`
//! prints (`... on http://ADDR ...`) and serves until killed.
//!
//! Usage: `rlserve-test-child MODEL_DIR FEEDBACK_DIR`.

use server::serve::ServeArgs;
use std::path::PathBuf;

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let [_, model, feedback] = args.as_slice() else {
        eprintln!("usage: rlserve-test-child MODEL_DIR FEEDBACK_DIR");
        std::process::exit(2);
    };
    let mut serve = ServeArgs { port: 0, served_model_name: Some("child".into()), ..Default::default() };
    serve.feedback.learn_from_feedback = true;
    serve.feedback.feedback_dir = PathBuf::from(feedback);
    serve.feedback.feedback_batch_size = 2;
    serve.feedback.feedback_save_steps = 1;
    serve.feedback.learning_rate = Some(1e-2);
    let rt = tokio::runtime::Builder::new_multi_thread().enable_all().build().expect("a runtime");
    if let Err(e) = rt.block_on(server::serve::run(&PathBuf::from(model), serve)) {
        eprintln!("error: {e:#}");
        std::process::exit(1);
    }
}
