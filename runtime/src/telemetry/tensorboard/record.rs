//! The TFRecord framing of an event file: each record is its length (u64, little-endian), the masked CRC32C of
//! those 8 bytes, the data, and the masked CRC32C of the data. TensorBoard's reader checks both CRCs, so a torn
//! or corrupted record is refused rather than read as a wrong value.
//!
//! ```text
//!  Event bytes ──frame──▶ [len u64 LE][mask(crc32c(len)) u32 LE][data][mask(crc32c(data)) u32 LE] ──▶ file
//!  file ──read_records──▶ each record's data, or the offset of the first that does not check
//! ```

/// The mask TensorFlow adds to every stored CRC (a CRC of data that holds CRCs is otherwise weak): rotate right
/// by 15 bits, then add a constant.
pub fn masked_crc32c(data: &[u8]) -> u32 {
    let crc = crc32c::crc32c(data);
    crc.rotate_right(15).wrapping_add(0xa282_ead8)
}

/// `data` framed as one record.
pub fn frame(data: &[u8]) -> Vec<u8> {
    let length = (data.len() as u64).to_le_bytes();
    let mut record = Vec::with_capacity(data.len() + 16);
    record.extend_from_slice(&length);
    record.extend_from_slice(&masked_crc32c(&length).to_le_bytes());
    record.extend_from_slice(data);
    record.extend_from_slice(&masked_crc32c(data).to_le_bytes());
    record
}

/// A record that does not read back.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum RecordError {
    /// The file ends inside a record (a torn last write).
    #[error("the record at byte {offset} is cut off: {needed} bytes needed, {left} left")]
    Truncated {
        /// Where the record starts.
        offset: usize,
        /// Bytes the record needs from its start.
        needed: usize,
        /// Bytes left in the file from its start.
        left: usize,
    },
    /// A stored CRC differs from the one computed.
    #[error(
        "the {part} CRC of the record at byte {offset} does not match (stored {stored:#010x}, computed {computed:#010x})"
    )]
    Crc {
        /// Where the record starts.
        offset: usize,
        /// `"length"` or `"data"`.
        part: &'static str,
        /// The CRC in the file.
        stored: u32,
        /// The CRC of the bytes read.
        computed: u32,
    },
}

/// The data of every record in `bytes`, in order, each CRC checked.
///
/// # Errors
/// The first record that is cut off or whose length or data does not match its CRC.
pub fn read_records(bytes: &[u8]) -> Result<Vec<&[u8]>, RecordError> {
    let mut records = Vec::new();
    let mut offset = 0;
    while offset < bytes.len() {
        let left = bytes.len() - offset;
        let at = &bytes[offset..];
        if left < 12 {
            return Err(RecordError::Truncated {
                offset,
                needed: 12,
                left,
            });
        }
        let (length, rest) = at.split_at(8);
        check(offset, "length", length, &rest[..4])?;
        let data_len = usize::try_from(u64::from_le_bytes(length.try_into().expect("8 bytes")))
            .unwrap_or(usize::MAX);
        let needed = data_len.saturating_add(16);
        if left < needed {
            return Err(RecordError::Truncated {
                offset,
                needed,
                left,
            });
        }
        let data = &at[12..12 + data_len];
        check(offset, "data", data, &at[12 + data_len..needed])?;
        records.push(data);
        offset += needed;
    }
    Ok(records)
}

fn check(offset: usize, part: &'static str, data: &[u8], stored: &[u8]) -> Result<(), RecordError> {
    let stored = u32::from_le_bytes(stored.try_into().expect("4 bytes"));
    let computed = masked_crc32c(data);
    if stored == computed {
        Ok(())
    } else {
        Err(RecordError::Crc {
            offset,
            part,
            stored,
            computed,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn crc32c_has_the_castagnoli_check_value() {
        // The check value of CRC-32C (iSCSI, RFC 3720) over the nine ASCII digits.
        assert_eq!(crc32c::crc32c(b"123456789"), 0xE306_9283);
        // ((crc >> 15) | (crc << 17)) + 0xa282ead8, worked out by hand for that CRC.
        assert_eq!(masked_crc32c(b"123456789"), 0xC78A_B0E5);
    }

    #[test]
    fn a_record_is_length_crc_data_crc() {
        let record = frame(b"abc");
        assert_eq!(record.len(), 3 + 16);
        assert_eq!(&record[..8], &3u64.to_le_bytes());
        assert_eq!(
            &record[8..12],
            &masked_crc32c(&3u64.to_le_bytes()).to_le_bytes()
        );
        assert_eq!(&record[12..15], b"abc");
        assert_eq!(&record[15..], &masked_crc32c(b"abc").to_le_bytes());
    }

    #[test]
    fn records_read_back_in_order() {
        let mut file = frame(b"first");
        file.extend(frame(b""));
        file.extend(frame(&[7u8; 300]));
        let records = read_records(&file).unwrap();
        assert_eq!(records, vec![&b"first"[..], &b""[..], &[7u8; 300][..]]);
    }

    #[test]
    fn a_flipped_byte_anywhere_is_caught() {
        let mut file = frame(b"first");
        let second = file.len();
        file.extend(frame(b"second record"));
        for at in 0..file.len() {
            let mut corrupted = file.clone();
            corrupted[at] ^= 0x10;
            let error = read_records(&corrupted).expect_err("a corrupted byte must not read back");
            let record = if at < second { 0 } else { second };
            match error {
                RecordError::Crc { offset, .. } | RecordError::Truncated { offset, .. } => {
                    assert_eq!(offset, record, "byte {at}: {error}")
                }
            }
        }
    }

    #[test]
    fn a_torn_last_record_is_cut_off() {
        let mut file = frame(b"first");
        let whole = file.len();
        file.extend(frame(b"second"));
        let error = read_records(&file[..file.len() - 1]).unwrap_err();
        assert!(
            matches!(error, RecordError::Truncated { offset, .. } if offset == whole),
            "{error}"
        );
    }
}
