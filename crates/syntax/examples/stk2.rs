fn main() {
    println!(
        "Expr {} ExprKind {} Ty {} Param {} TypeExpr {} Pattern {} Function {}",
        std::mem::size_of::<tumble_ir::Expr>(),
        std::mem::size_of::<tumble_ir::ExprKind>(),
        std::mem::size_of::<tumble_ir::Ty>(),
        std::mem::size_of::<tumble_ir::Param>(),
        std::mem::size_of::<tumble_ir::TypeExpr>(),
        std::mem::size_of::<tumble_ir::Pattern>(),
        std::mem::size_of::<tumble_ir::Function>()
    );
}
