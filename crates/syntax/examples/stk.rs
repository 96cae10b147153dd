fn main() {
    let body = std::env::args().nth(1).unwrap();
    let _ = tumble_syntax::parse_module(
        &format!("def @main(%x, %c) {{ {body} }}"),
        tumble_ir::SourceId(0),
    );
}
