//! The registry. One entry per operator; relations live in submodules by fusion class.

use crate::{FusionClass, OpDef, RelError};
use tumble_ir::{Attrs, Ty};

static OPS: &[OpDef] = &[OpDef {
    name: "add",
    arity: 2,
    attrs: &[],
    relation: placeholder_broadcast,
    class: FusionClass::Broadcast,
    doc: "elementwise a + b with numpy broadcasting",
}];

pub fn all() -> &'static [OpDef] {
    OPS
}

fn placeholder_broadcast(args: &[Ty], _attrs: &Attrs) -> Result<Ty, RelError> {
    args.first()
        .cloned()
        .ok_or_else(|| RelError::new("add: expected 2 arguments"))
}
