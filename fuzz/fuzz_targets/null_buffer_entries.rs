//! Every C ABI entry that takes a buffer handle, called with a NULL handle and arbitrary other
//! arguments (descriptors over a small host scratch area or NULL, args structs filled from the
//! fuzz bytes, edge-biased ints): must return INVALID_ARGUMENT (free(NULL) is a documented
//! no-op: SUCCESS). Out-params are valid locals or NULL, never wild; streams are NULL (a wild
//! stream would be handed to CUDA only after the handle check, which this target proves first).
//! The entries and their arguments: fuzz_common::entries (shared with buffer_handles).
#![no_main]
use std::ptr::null_mut;

use deepep_nccl::DeepepStatus;
use fuzz_common::entries::{self, Scratch};
use fuzz_common::*;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let mut u = Unstructured::new(data);
    let mut ctx = Scratch::new(true);
    while !u.is_empty() {
        let which = u.int_in_range(0u8..=entries::COUNT - 1).unwrap_or(0);
        let (what, s) = entries::call(&mut u, &mut ctx, which, null_mut());
        no_internal(what, s);
        if which == entries::FREE {
            assert_eq!(s, DeepepStatus::DEEPEP_SUCCESS, "free(NULL) is a no-op");
        } else {
            assert_eq!(s, DeepepStatus::DEEPEP_ERROR_INVALID_ARGUMENT, "{what}(NULL buffer): {}", last_error());
        }
    }
});
