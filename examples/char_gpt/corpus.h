#pragma once
// The training text: every file under a directory (by default the licence texts every Debian
// system ships in /usr/share/common-licenses), a character vocabulary built from all of it, and
// a held-out split made of the last part of every file, so validation sees every kind of text.

#include <cstdint>
#include <string>
#include <vector>

#include <ATen/core/Tensor.h>

namespace char_gpt {

struct Corpus {
  std::vector<std::string> files;  // the files read, in order (symlinks to read files skipped)
  std::string vocabulary;          // sorted distinct bytes; token id = position in it
  at::Tensor train;                // int64 token ids, 1-D
  at::Tensor validation;           // int64 token ids, 1-D
  double unigram_entropy = 0.0;    // nats per character of the training text's byte frequencies
  // Cross-entropy of the validation text under the training unigram distribution (nats): what a
  // model that learned only character frequencies would score on validation.
  double unigram_validation_loss = 0.0;
  int64_t vocab_size() const { return static_cast<int64_t>(vocabulary.size()); }
};

// Reads every regular file in `directory` (sorted by name, duplicates through symlinks read
// once). The last `validation_fraction` of each file goes to validation. Throws when the
// directory holds no text.
Corpus load_corpus(const std::string& directory, double validation_fraction);

// Random windows of seq_len + 1 tokens from `data`: inputs are the first seq_len, targets the
// last seq_len. Deterministic for a given generator state.
struct Batch {
  at::Tensor inputs;   // (batch, seq_len) int64
  at::Tensor targets;  // (batch, seq_len) int64
};
Batch sample_batch(const at::Tensor& data, int64_t batch, int64_t seq_len, at::Generator& gen);

// The validation text cut into consecutive, non-overlapping windows; window i goes to rank
// i % world_size, so together the ranks evaluate every window once.
Batch validation_windows(const at::Tensor& data, int64_t seq_len, int rank, int world_size);

}  // namespace char_gpt
