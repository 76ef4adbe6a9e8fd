//! The crate's two sorts, in place of the standard library's.
//!
//! Why not `slice::sort*`: each call site instantiates the standard library's driftsort or
//! ipnsort, several kilobytes of Wasm per element type (`make bench-size` measured 26 KB of
//! sort code for five call sites, 8% of the module). The sites here sort either a handful of
//! elements or a JSON object's members, so two small algorithms do: an insertion sort for slices
//! bounded by a constant, and a heapsort (O(n log n) in every case, so a hostile body with many
//! members cannot make it quadratic) for the rest.

/// Stable insertion sort by key. Quadratic: only for slices whose length is bounded by a
/// constant (two candidate buckets, one bucket's entries, the workers of one Envoy).
pub fn small_by_key<T, K: Ord>(v: &mut [T], mut key: impl FnMut(&T) -> K) {
    for i in 1..v.len() {
        let mut j = i;
        // Strictly greater: equal keys keep their order.
        while j > 0 && key(&v[j - 1]) > key(&v[j]) {
            v.swap(j - 1, j);
            j -= 1;
        }
    }
}

/// Heapsort by `less`; not stable. For slices of any length (a request body's object members).
pub fn heap_by<T>(v: &mut [T], less: impl Fn(&T, &T) -> bool) {
    let sift_down = |v: &mut [T], mut node: usize, end: usize| loop {
        let mut child = 2 * node + 1;
        if child >= end {
            return;
        }
        if child + 1 < end && less(&v[child], &v[child + 1]) {
            child += 1;
        }
        if !less(&v[node], &v[child]) {
            return;
        }
        v.swap(node, child);
        node = child;
    };
    let n = v.len();
    for node in (0..n / 2).rev() {
        sift_down(v, node, n);
    }
    for end in (1..n).rev() {
        v.swap(0, end);
        sift_down(v, 0, end);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every arrangement of up to 7 elements with repeated values, against the standard sort.
    #[test]
    fn both_sorts_agree_with_the_standard_library_on_every_small_input() {
        for len in 0..=7u32 {
            let arrangements = 4u32.pow(len);
            for code in 0..arrangements {
                let input: Vec<(u32, usize)> =
                    (0..len).map(|i| ((code / 4u32.pow(i)) % 4, i as usize)).collect();
                let mut expected = input.clone();
                expected.sort_by_key(|e| e.0);

                let mut stable = input.clone();
                small_by_key(&mut stable, |e| e.0);
                assert_eq!(stable, expected, "insertion sort of {input:?}");

                let mut heap = input.clone();
                heap_by(&mut heap, |a, b| a.0 < b.0);
                let keys = |v: &[(u32, usize)]| v.iter().map(|e| e.0).collect::<Vec<_>>();
                assert_eq!(keys(&heap), keys(&expected), "heapsort of {input:?}");
                let mut same_elements = heap.clone();
                same_elements.sort();
                let mut input_sorted = input.clone();
                input_sorted.sort();
                assert_eq!(same_elements, input_sorted, "heapsort lost or made up an element");
            }
        }
    }

    #[test]
    fn heapsort_sorts_large_and_adversarial_inputs() {
        let mut x: u64 = 0x9E37_79B9_7F4A_7C15;
        let mut random: Vec<u64> = (0..10_000)
            .map(|_| {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                x % 1000
            })
            .collect();
        for v in [
            &mut random,
            &mut (0..10_000u64).collect::<Vec<_>>(),
            &mut (0..10_000u64).rev().collect::<Vec<_>>(),
            &mut vec![7u64; 10_000],
        ] {
            let mut expected = v.clone();
            expected.sort_unstable();
            heap_by(v, |a, b| a < b);
            assert_eq!(*v, expected);
        }
    }
}
