//! A producer slot's part-filled queue items, one per bucket, kept open across messages.
//!
//! ```text
//!  message rows ──place (copy, or read straight off the socket)──▶ open item of the row's bucket
//!        full ──hand_out (swap with a pooled batch, no copy)──▶ HS queue
//!        part-filled ──held for the next message; handed out when the producer is done, gone or idle
//! ```
//!
//! A producer that sends a few sequences per message (one forward pass of a `transformers` model) would
//! otherwise queue a padded item for every bucket each message touches: with messages of 8 mixed-length
//! prompts, 25–29% of token slots held a real token. Rows fill the slot's open item of their bucket, and an
//! item goes to the queue when its last sequence slot is filled, so the padding left is the tail of each row
//! (up to its bucket's length) and the part-filled items a producer leaves when it stops.

use crate::batch::HsBatch;
use crate::source::BucketShapes;

/// One open item per bucket, allocated when its bucket first gets a row.
#[derive(Debug, Default)]
pub(super) struct OpenItems {
    items: Vec<Option<HsBatch>>,
    /// Sequence slots filled, per bucket.
    filled: Vec<usize>,
    /// `filled` when the message being placed began (0 once its bucket was handed out since), to take back
    /// the rows of a message refused half-way.
    mark: Vec<usize>,
}

impl OpenItems {
    pub(super) fn new(buckets: usize) -> Self {
        Self {
            items: (0..buckets).map(|_| None).collect(),
            filled: vec![0; buckets],
            mark: vec![0; buckets],
        }
    }

    /// Free sequence slots of `bucket`'s open item.
    pub(super) fn room(&self, bucket: usize, shapes: &BucketShapes) -> usize {
        shapes.buckets[bucket].1 - self.filled[bucket]
    }

    /// Free sequence slots per bucket.
    pub(super) fn rooms(&self, shapes: &BucketShapes) -> Vec<usize> {
        (0..self.filled.len())
            .map(|b| self.room(b, shapes))
            .collect()
    }

    /// `bucket`'s open item (shaped for it) and its first free sequence slot.
    pub(super) fn next_slot(
        &mut self,
        bucket: usize,
        shapes: &BucketShapes,
    ) -> (&mut HsBatch, usize) {
        let item = self.items[bucket].get_or_insert_with(|| {
            let mut item = shapes.buffer();
            shapes.shape_for(&mut item, bucket);
            item
        });
        (item, self.filled[bucket])
    }

    /// Records `rows` more slots of `bucket` as filled; true when its item is now full.
    pub(super) fn filled(&mut self, bucket: usize, rows: usize, shapes: &BucketShapes) -> bool {
        self.filled[bucket] += rows;
        self.room(bucket, shapes) == 0
    }

    /// Remembers the fill of every bucket before a message is placed.
    pub(super) fn mark(&mut self) {
        self.mark.clone_from(&self.filled);
    }

    /// Takes back the rows placed since [`Self::mark`] (of a message refused half-way); rows already handed
    /// out with a full item stay queued, as the items of a message cut off before its acknowledgement do.
    pub(super) fn roll_back(&mut self) {
        self.filled.clone_from(&self.mark);
    }

    /// The first bucket whose open item holds a row.
    pub(super) fn first_held(&self) -> Option<usize> {
        self.filled.iter().position(|&n| n > 0)
    }

    /// Rows held in open items.
    pub(super) fn held(&self) -> usize {
        self.filled.iter().sum()
    }

    /// Hands `bucket`'s open item out by swapping it with `out` (a pooled batch of the same shape), its free
    /// slots zeroed; `out`'s old buffer becomes the open item, empty. False when `out` has another shape.
    pub(super) fn hand_out(
        &mut self,
        bucket: usize,
        out: &mut HsBatch,
        shapes: &BucketShapes,
    ) -> bool {
        let filled = self.filled[bucket];
        let Some(item) = self.items[bucket].as_mut() else {
            return false;
        };
        if filled == 0 || !shapes.matches(out, bucket) {
            return false;
        }
        let (padded, din) = (item.padded_len, item.din);
        item.seq_lens[filled..].fill(0);
        item.input_ids[filled * padded..].fill(0);
        item.loss_mask[filled * padded..].fill(0);
        let tokens = item.sequences * padded;
        item.hs.zero(filled * padded * din..tokens * din);
        std::mem::swap(item, out);
        self.filled[bucket] = 0;
        self.mark[bucket] = 0;
        true
    }
}
