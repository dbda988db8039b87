#include "corpus.h"

#include <algorithm>
#include <array>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <set>
#include <sstream>

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

namespace char_gpt {
namespace fs = std::filesystem;

namespace {

std::string read_file(const fs::path& path) {
  std::ifstream in(path, std::ios::binary);
  TORCH_CHECK(in, "char_gpt: cannot read ", path.string());
  std::ostringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

at::Tensor encode(const std::string& text, const std::array<int64_t, 256>& id) {
  at::Tensor out = at::empty({static_cast<int64_t>(text.size())}, at::kLong);
  int64_t* p = out.data_ptr<int64_t>();
  for (size_t i = 0; i < text.size(); ++i) p[i] = id[static_cast<unsigned char>(text[i])];
  return out;
}

}  // namespace

Corpus load_corpus(const std::string& directory, double validation_fraction) {
  TORCH_CHECK(validation_fraction > 0.0 && validation_fraction < 1.0,
              "char_gpt: --val-fraction must be in (0, 1), got ", validation_fraction);
  TORCH_CHECK(fs::is_directory(directory), "char_gpt: --data ", directory,
              " is not a directory (point it at a folder of text files)");
  std::vector<fs::path> paths;
  for (const auto& entry : fs::directory_iterator(directory)) {
    if (entry.is_regular_file()) paths.push_back(entry.path());
  }
  std::sort(paths.begin(), paths.end());

  Corpus corpus;
  std::string train_text, validation_text;
  std::set<fs::path> seen;  // GPL -> GPL-3 and friends: read each text once
  for (const auto& path : paths) {
    if (!seen.insert(fs::canonical(path)).second) continue;
    const std::string text = read_file(path);
    if (text.empty()) continue;
    const size_t cut = static_cast<size_t>(text.size() * (1.0 - validation_fraction));
    train_text.append(text, 0, cut);
    validation_text.append(text, cut, std::string::npos);
    corpus.files.push_back(path.string());
  }
  TORCH_CHECK(train_text.size() > 1000 && validation_text.size() > 100, "char_gpt: ", directory,
              " holds too little text (", train_text.size(), " training bytes)");

  std::array<int64_t, 256> train_count{};
  std::array<bool, 256> present{};
  for (unsigned char c : train_text) ++train_count[c], present[c] = true;
  for (unsigned char c : validation_text) present[c] = true;
  std::array<int64_t, 256> id{};
  for (int c = 0; c < 256; ++c) {
    if (present[c]) {
      id[c] = static_cast<int64_t>(corpus.vocabulary.size());
      corpus.vocabulary.push_back(static_cast<char>(c));
    }
  }

  // Unigram entropy of the training text, and the validation cross-entropy under it (with
  // add-one smoothing so a byte unseen in training does not give an infinite loss).
  const double n = static_cast<double>(train_text.size());
  double entropy = 0.0;
  for (int64_t count : train_count) {
    if (count > 0) entropy -= (count / n) * std::log(count / n);
  }
  const double v = static_cast<double>(corpus.vocabulary.size());
  double cross = 0.0;
  for (unsigned char c : validation_text) cross -= std::log((train_count[c] + 1.0) / (n + v));
  corpus.unigram_entropy = entropy;
  corpus.unigram_validation_loss = cross / static_cast<double>(validation_text.size());

  corpus.train = encode(train_text, id);
  corpus.validation = encode(validation_text, id);
  return corpus;
}

Batch sample_batch(const at::Tensor& data, int64_t batch, int64_t seq_len, at::Generator& gen) {
  const int64_t n = data.size(0);
  TORCH_CHECK(n > seq_len + 1, "char_gpt: --seq-len ", seq_len, " is longer than the text (", n,
              " tokens)");
  const at::Tensor starts = at::randint(n - seq_len - 1, {batch, 1}, gen, at::kLong);
  const at::Tensor index = starts + at::arange(seq_len + 1, at::kLong).unsqueeze(0);
  const at::Tensor windows = data.index_select(0, index.reshape({-1})).reshape({batch, -1});
  return {windows.narrow(1, 0, seq_len).contiguous(), windows.narrow(1, 1, seq_len).contiguous()};
}

Batch validation_windows(const at::Tensor& data, int64_t seq_len, int rank, int world_size) {
  const int64_t windows = (data.size(0) - 1) / seq_len;
  TORCH_CHECK(windows >= 1, "char_gpt: the validation text is shorter than --seq-len ", seq_len);
  const at::Tensor inputs = data.narrow(0, 0, windows * seq_len).reshape({windows, seq_len});
  const at::Tensor targets = data.narrow(0, 1, windows * seq_len).reshape({windows, seq_len});
  const at::Tensor mine = at::arange(rank, windows, world_size, at::kLong);
  return {inputs.index_select(0, mine), targets.index_select(0, mine)};
}

}  // namespace char_gpt
