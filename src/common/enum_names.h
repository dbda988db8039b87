#pragma once
// The one way fsdp_muon names the values of an enum (to_string, parse_*, and the lists of
// accepted names in messages): a table of {value, name} rows in enumerator order, checked at
// compile time, and these lookups over it. Adding an enumerator means adding its row; a row out
// of place fails the build. Internal header.

#include <cstddef>
#include <optional>
#include <string>
#include <string_view>

namespace fsdp_muon::detail {

template <typename Enum>
struct EnumName {
  Enum value;
  const char* name;
};

// True when row i holds enumerator i, for every row: the table lists the values from the first
// in order (so a row can be neither missing in the middle nor repeated). Use in a static_assert.
template <typename Enum, std::size_t N>
constexpr bool rows_in_enumerator_order(const EnumName<Enum> (&table)[N]) {
  for (std::size_t i = 0; i < N; ++i) {
    if (static_cast<std::size_t>(table[i].value) != i) return false;
  }
  return true;
}

// The name of `value`, or "unknown" for a value no row has (an integer cast to the enum).
template <typename Enum, std::size_t N>
constexpr const char* name_of(const EnumName<Enum> (&table)[N], Enum value) {
  for (const auto& row : table) {
    if (row.value == value) return row.name;
  }
  return "unknown";
}

// The value of that name (exactly as the table spells it), or nullopt for any other text.
template <typename Enum, std::size_t N>
std::optional<Enum> value_named(const EnumName<Enum> (&table)[N], std::string_view name) {
  for (const auto& row : table) {
    if (name == row.name) return row.value;
  }
  return std::nullopt;
}

// "a, b, c": every name, in order, for the messages that say what is accepted.
template <typename Enum, std::size_t N>
std::string all_names(const EnumName<Enum> (&table)[N]) {
  std::string names;
  for (const auto& row : table) names += (names.empty() ? "" : ", ") + std::string(row.name);
  return names;
}

}  // namespace fsdp_muon::detail
