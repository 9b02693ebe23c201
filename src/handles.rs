//! The opaque handles the C ABI hands out (today one kind: buffers). A handle is a value,
//! never an address: a tag, the kind, the generation of a slot and the slot's index, packed
//! into a pointer-sized integer and checked against a [`Registry`] on every call. A freed
//! (destroyed), twice-freed or made-up handle is then an error naming the argument and saying
//! which of these it is, never a read of freed or wild memory.
//!
//! Layout (64 bits): bits 48..63 [`TAG`], 40..47 the [`HandleKind`], 16..39 the generation
//! (1 for a slot's first handle, one more each time the slot is reused), 0..15 the slot. A
//! user-space address has its top 16 bits clear (its top byte at most a tag, with the 8 bits
//! below it clear), so a pointer passed as a handle fails the tag check.
//!
//! A lookup takes only its own slot's lock (slots sit in chunks that never move, each on its own
//! cache line) and clones an `Arc`: about 20 ns, and threads looking up different handles share
//! no lock or line (bench/handle_lookup.rs). The lock is held only for the lookup, never during
//! an op, so a collective call on one thread never blocks another thread's calls. A handle
//! freed while another thread is still inside a call with it stays alive until that call
//! returns (the call holds the `Arc`).
use std::collections::VecDeque;
use std::fmt;
use std::sync::{Arc, Mutex, MutexGuard, OnceLock};

use crate::error::{Error, Result};

const _: () = assert!(usize::BITS == 64, "handles pack 64 bits into a pointer-sized value");

/// "DE": the top 16 bits of every handle (positive as an int64, for bindings that hold handles
/// in signed integers).
const TAG: u64 = 0x4445;
const TAG_SHIFT: u32 = 48;
const KIND_SHIFT: u32 = 40;
const GENERATION_SHIFT: u32 = 16;
const GENERATION_BITS: u32 = 24;
const SLOT_BITS: u32 = 16;
/// Most handles of one kind alive at once.
pub(crate) const MAX_SLOTS: usize = 1 << SLOT_BITS;
/// A slot whose generation reaches this is retired (never reused), so that a stale handle can
/// never match a later one of the same slot.
const MAX_GENERATION: u32 = (1 << GENERATION_BITS) - 1;

/// What a handle refers to (its byte in the handle).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum HandleKind {
    Buffer = 1,
    /// Only for the registry's own tests of the wrong-kind check.
    #[cfg(test)]
    Test = 0x7f,
}

impl HandleKind {
    const ALL: &'static [Self] = &[
        Self::Buffer,
        #[cfg(test)]
        Self::Test,
    ];

    fn from_bits(bits: u64) -> Option<Self> {
        Self::ALL.iter().copied().find(|k| *k as u64 == bits)
    }

    fn name(self) -> &'static str {
        match self {
            Self::Buffer => "buffer",
            #[cfg(test)]
            Self::Test => "test",
        }
    }

    /// The C ABI calls that create and release this kind.
    fn create_and_free(self) -> (&'static str, &'static str) {
        match self {
            Self::Buffer => ("deepep_buffer_create", "deepep_buffer_free"),
            #[cfg(test)]
            Self::Test => ("Registry::insert", "Registry::remove"),
        }
    }
}

/// A handle's fields (what [`Registry::get`] checks).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Decoded {
    tag: u64,
    kind: u64,
    generation: u32,
    slot: usize,
}

impl Decoded {
    fn of(handle: usize) -> Self {
        let h = handle as u64;
        Self {
            tag: h >> TAG_SHIFT,
            kind: (h >> KIND_SHIFT) & 0xff,
            generation: ((h >> GENERATION_SHIFT) & ((1 << GENERATION_BITS) - 1)) as u32,
            slot: (h & ((1 << SLOT_BITS) - 1)) as usize,
        }
    }

    fn encode(kind: HandleKind, generation: u32, slot: usize) -> usize {
        debug_assert!(generation >= 1 && generation <= MAX_GENERATION && slot < MAX_SLOTS);
        ((TAG << TAG_SHIFT) | ((kind as u64) << KIND_SHIFT) | ((generation as u64) << GENERATION_SHIFT) | slot as u64) as usize
    }
}

/// A handle value as messages print it.
struct Hex(usize);

impl fmt::Display for Hex {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{:#x}", self.0)
    }
}

/// Slots are allocated in chunks that never move, so a lookup indexes them without a global lock.
const CHUNK: usize = 64;
const CHUNKS: usize = MAX_SLOTS / CHUNK;

/// One slot, alone on its cache line: lookups of different handles from different threads
/// share no lock and no line.
#[repr(align(64))]
struct Slot<T>(Mutex<SlotState<T>>);

struct SlotState<T> {
    /// Generation of the last handle this slot gave out (0: none yet).
    generation: u32,
    value: Option<Arc<T>>,
}

impl<T> Slot<T> {
    /// Ignores poison: every critical section below either completes or changes nothing.
    fn lock(&self) -> MutexGuard<'_, SlotState<T>> {
        self.0.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
    }
}

/// Which slots are in use (only creation and release take this lock).
struct Allocation {
    /// Slots ever used: [0, used).
    used: usize,
    /// Free slots, reused oldest first: a stale handle's slot is reused as late as possible.
    free: VecDeque<usize>,
    live: usize,
}

/// The live handles of one kind: a slot table with a generation per slot.
pub(crate) struct Registry<T> {
    kind: HandleKind,
    chunks: [OnceLock<Box<[Slot<T>; CHUNK]>>; CHUNKS],
    allocation: Mutex<Allocation>,
}

impl<T> Registry<T> {
    pub(crate) const fn new(kind: HandleKind) -> Self {
        Self {
            kind,
            chunks: [const { OnceLock::new() }; CHUNKS],
            allocation: Mutex::new(Allocation { used: 0, free: VecDeque::new(), live: 0 }),
        }
    }

    fn allocation(&self) -> MutexGuard<'_, Allocation> {
        self.allocation.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    /// Slot `i` if it was ever used.
    fn slot(&self, i: usize) -> Option<&Slot<T>> {
        self.chunks.get(i / CHUNK)?.get().map(|chunk| &chunk[i % CHUNK])
    }

    /// Registers `value`; returns its handle (never 0). Fails only with MAX_SLOTS handles alive.
    pub(crate) fn insert(&self, value: T) -> Result<usize> {
        let mut a = self.allocation();
        let i = match a.free.pop_front() {
            Some(i) => i,
            None if a.used < MAX_SLOTS => {
                a.used += 1;
                a.used - 1
            }
            None => {
                return Err(Error::invalid(format!(
                    "too many {} handles alive ({MAX_SLOTS}); free some first",
                    self.kind.name()
                )))
            }
        };
        a.live += 1;
        let chunk = self.chunks[i / CHUNK].get_or_init(|| {
            Box::new(std::array::from_fn(|_| Slot(Mutex::new(SlotState { generation: 0, value: None }))))
        });
        let mut slot = chunk[i % CHUNK].lock();
        slot.generation += 1;
        slot.value = Some(Arc::new(value));
        Ok(Decoded::encode(self.kind, slot.generation, i))
    }

    /// Whether there is room for one more handle (checked before expensive creations).
    pub(crate) fn has_room(&self) -> bool {
        let a = self.allocation();
        !a.free.is_empty() || a.used < MAX_SLOTS
    }

    /// The value of a live handle. `name` is the argument's name for the error, which says
    /// whether the handle is NULL, was freed, was never created, or is another kind's. Takes
    /// only the handle's own slot lock.
    pub(crate) fn get(&self, name: &str, handle: usize) -> Result<Arc<T>> {
        let d = self.check_shape(name, handle)?;
        let Some(slot) = self.slot(d.slot) else {
            return Err(self.stale(name, handle, d, None));
        };
        let slot = slot.lock();
        match &slot.value {
            Some(v) if slot.generation == d.generation => Ok(Arc::clone(v)),
            _ => Err(self.stale(name, handle, d, Some(slot.generation))),
        }
    }

    /// Unregisters a live handle and returns its value (dropped by the caller, outside the
    /// registry's locks: the value's own teardown runs when the last call still holding it
    /// returns). Errors as [`Self::get`].
    pub(crate) fn remove(&self, name: &str, handle: usize) -> Result<Arc<T>> {
        let d = self.check_shape(name, handle)?;
        let mut a = self.allocation();
        let Some(slot) = self.slot(d.slot) else {
            return Err(self.stale(name, handle, d, None));
        };
        let mut slot = slot.lock();
        if slot.generation != d.generation || slot.value.is_none() {
            return Err(self.stale(name, handle, d, Some(slot.generation)));
        }
        let value = slot.value.take().expect("checked live above");
        a.live -= 1;
        if d.generation < MAX_GENERATION {
            a.free.push_back(d.slot);
        }
        Ok(value)
    }

    /// Handles alive now.
    pub(crate) fn live(&self) -> usize {
        self.allocation().live
    }

    /// NULL, tag and kind: what a handle shows without the table.
    fn check_shape(&self, name: &str, handle: usize) -> Result<Decoded> {
        let kind = self.kind.name();
        if handle == 0 {
            return Err(Error::invalid(format!("{name} must not be NULL")));
        }
        let d = Decoded::of(handle);
        let (create, _) = self.kind.create_and_free();
        if d.tag != TAG {
            return Err(Error::invalid(format!(
                "{name} ({}) was never created: it is not a deepep-nccl handle (a {kind} handle comes from {create}; \
                 an address or a made-up value is not one)",
                Hex(handle)
            )));
        }
        match HandleKind::from_bits(d.kind) {
            Some(k) if k == self.kind => Ok(d),
            Some(other) => Err(Error::invalid(format!(
                "{name} ({}) is a {} handle, not a {kind} handle (wrong kind)",
                Hex(handle),
                other.name()
            ))),
            None => Err(Error::invalid(format!(
                "{name} ({}) was never created: it has no valid handle kind ({kind} handles come from {create})",
                Hex(handle)
            ))),
        }
    }

    /// The error for a handle of the right shape that is not live: freed, or never given out.
    fn stale(&self, name: &str, handle: usize, d: Decoded, slot_generation: Option<u32>) -> Error {
        let kind = self.kind.name();
        let (create, free) = self.kind.create_and_free();
        let given_out = slot_generation.is_some_and(|g| d.generation >= 1 && d.generation <= g);
        if given_out {
            Error::invalid(format!(
                "{name} ({}) was destroyed: {free} released this {kind} handle, and a released handle must not be \
                 used or freed again",
                Hex(handle)
            ))
        } else {
            Error::invalid(format!(
                "{name} ({}) was never created: {create} gave out no {kind} handle with this value",
                Hex(handle)
            ))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn registry() -> Registry<String> {
        Registry::new(HandleKind::Buffer)
    }

    fn err(r: Result<Arc<String>>) -> String {
        r.map(|_| ()).unwrap_err().message
    }

    #[test]
    fn live_handles_resolve_and_freed_ones_are_named() {
        let r = registry();
        let a = r.insert("a".into()).unwrap();
        let b = r.insert("b".into()).unwrap();
        assert_ne!(a, b);
        assert_eq!(*r.get("buffer", a).unwrap(), "a");
        assert_eq!(*r.get("buffer", b).unwrap(), "b");
        assert_eq!(r.live(), 2);
        assert_eq!(*r.remove("buffer", a).unwrap(), "a");
        assert_eq!(r.live(), 1);
        let used = err(r.get("buffer", a));
        assert!(used.starts_with(&format!("buffer ({a:#x}) was destroyed: deepep_buffer_free released this buffer handle")), "{used}");
        let twice = err(r.remove("buffer", a));
        assert!(twice.contains("was destroyed") && twice.contains("must not be used or freed again"), "{twice}");
        assert_eq!(*r.get("buffer", b).unwrap(), "b", "other handles are unaffected");
    }

    #[test]
    fn a_reused_slot_gets_a_new_generation_and_old_handles_stay_dead() {
        let r = registry();
        let first = r.insert("first".into()).unwrap();
        r.remove("buffer", first).unwrap();
        let second = r.insert("second".into()).unwrap();
        assert_eq!(Decoded::of(first).slot, Decoded::of(second).slot, "the freed slot is reused");
        assert_eq!(Decoded::of(second).generation, Decoded::of(first).generation + 1);
        assert!(err(r.get("buffer", first)).contains("was destroyed"));
        assert_eq!(*r.get("buffer", second).unwrap(), "second");
    }

    #[test]
    fn made_up_values_were_never_created() {
        let r = registry();
        let live = r.insert("x".into()).unwrap();
        assert_eq!(err(r.get("buffer", 0)), "buffer must not be NULL");
        let address = &live as *const usize as usize;
        for bogus in [1, 0xdead_beef, address, usize::MAX, 0x8000_0000_0000_0000] {
            let e = err(r.get("buffer", bogus));
            assert!(e.contains("was never created: it is not a deepep-nccl handle"), "{bogus:#x}: {e}");
        }
        let d = Decoded::of(live);
        // Right tag and kind, but a slot or generation never given out.
        for (generation, slot) in [(d.generation + 1, d.slot), (0, d.slot), (1, d.slot + 1), (1, MAX_SLOTS - 1)] {
            let h = ((TAG << TAG_SHIFT) | (1 << KIND_SHIFT) | ((generation as u64) << GENERATION_SHIFT) | slot as u64) as usize;
            let e = err(r.get("buffer", h));
            assert!(e.contains("was never created: deepep_buffer_create gave out no buffer handle"), "{h:#x}: {e}");
        }
        // Right tag, a kind byte that is no kind.
        let unknown = live ^ (0x80 << KIND_SHIFT);
        assert!(err(r.get("buffer", unknown)).contains("has no valid handle kind"));
        assert_eq!(r.live(), 1);
    }

    #[test]
    fn another_kinds_handle_is_the_wrong_kind() {
        let buffers = registry();
        let tests: Registry<String> = Registry::new(HandleKind::Test);
        let t = tests.insert("t".into()).unwrap();
        let e = err(buffers.get("buffer", t));
        assert_eq!(e, format!("buffer ({t:#x}) is a test handle, not a buffer handle (wrong kind)"));
        assert!(buffers.remove("buffer", t).is_err());
        assert_eq!(*tests.get("handle", t).unwrap(), "t");
    }

    #[test]
    fn a_value_stays_alive_while_a_lookup_holds_it() {
        let r = registry();
        let h = r.insert("held".into()).unwrap();
        let held = r.get("buffer", h).unwrap();
        let removed = r.remove("buffer", h).unwrap();
        drop(removed);
        assert_eq!(*held, "held", "the in-flight call's reference keeps the value");
        assert_eq!(Arc::strong_count(&held), 1);
    }

    #[test]
    fn slots_are_bounded_and_retired_at_the_last_generation() {
        let r: Registry<u8> = Registry::new(HandleKind::Buffer);
        let first = r.insert(0).unwrap();
        r.remove("buffer", first).unwrap();
        r.slot(0).unwrap().lock().generation = MAX_GENERATION - 1;
        let last = r.insert(1).unwrap();
        assert_eq!(Decoded::of(last), Decoded { tag: TAG, kind: 1, generation: MAX_GENERATION, slot: 0 });
        r.remove("buffer", last).unwrap();
        let next = r.insert(2).unwrap();
        assert_eq!(Decoded::of(next).slot, 1, "slot 0 is retired, never reused");
        assert!(err_u8(r.get("buffer", last)).contains("was destroyed"));
        r.allocation().used = MAX_SLOTS;
        assert!(!r.has_room());
        assert!(r.insert(3).unwrap_err().message.starts_with("too many buffer handles alive (65536)"));
    }

    fn err_u8(r: Result<Arc<u8>>) -> String {
        r.map(|_| ()).unwrap_err().message
    }

    #[test]
    fn lookups_from_many_threads_agree() {
        let r = Arc::new(registry());
        let handles: Vec<usize> = (0..8).map(|i| r.insert(format!("v{i}")).unwrap()).collect();
        let threads: Vec<_> = (0..4)
            .map(|_| {
                let (r, handles) = (Arc::clone(&r), handles.clone());
                std::thread::spawn(move || {
                    for round in 0..1000 {
                        let i = round % handles.len();
                        assert_eq!(*r.get("buffer", handles[i]).unwrap(), format!("v{i}"));
                    }
                })
            })
            .collect();
        for t in threads {
            t.join().unwrap();
        }
    }
}
