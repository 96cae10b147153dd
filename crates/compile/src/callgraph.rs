//! Call-graph order for the analyses that size or cost a function by its callees (inlining,
//! ghost operators).

/// The functions `0..callees.len()` in an order where each comes after every function it calls,
/// cycles aside, and which of them close a cycle (reached again while the functions they call are
/// being visited: recursion). Iterative — a call chain may be 100,000 functions long — and linear
/// in the calls. Callee indices past the end are ignored.
pub(crate) fn callees_first(callees: &[Vec<usize>]) -> (Vec<usize>, Vec<bool>) {
    #[derive(Clone, Copy, PartialEq)]
    enum State {
        New,
        Active,
        Done,
    }
    let n = callees.len();
    let mut state = vec![State::New; n];
    let mut on_cycle = vec![false; n];
    let mut order = Vec::with_capacity(n);
    for root in 0..n {
        if state[root] != State::New {
            continue;
        }
        let mut stack: Vec<(usize, bool)> = vec![(root, false)];
        while let Some((f, expanded)) = stack.pop() {
            if expanded {
                state[f] = State::Done;
                order.push(f);
                continue;
            }
            if state[f] != State::New {
                continue;
            }
            state[f] = State::Active;
            stack.push((f, true));
            for &g in &callees[f] {
                match state.get(g) {
                    Some(State::New) => stack.push((g, false)),
                    Some(State::Active) => on_cycle[g] = true,
                    _ => {}
                }
            }
        }
    }
    (order, on_cycle)
}

#[cfg(test)]
mod tests {
    use super::callees_first;

    #[test]
    fn callees_come_first_and_cycles_are_found() {
        // 0 -> 1 -> 2, 3 -> 3 (self), 4 <-> 5, 6 -> 9 (outside)
        let callees = vec![vec![1], vec![2], vec![], vec![3], vec![5], vec![4], vec![9]];
        let (order, on_cycle) = callees_first(&callees);
        let at = |f: usize| order.iter().position(|&x| x == f).unwrap_or(usize::MAX);
        assert_eq!(order.len(), 7);
        assert!(at(2) < at(1) && at(1) < at(0));
        assert_eq!(
            on_cycle,
            vec![false, false, false, true, true, false, false]
        );
        // A chain far longer than any native stack.
        let chain: Vec<Vec<usize>> = (0..200_000).map(|i| vec![i + 1]).collect();
        let (order, on_cycle) = callees_first(&chain);
        assert_eq!(order.first(), Some(&199_999));
        assert!(on_cycle.iter().all(|&c| !c));
    }
}
