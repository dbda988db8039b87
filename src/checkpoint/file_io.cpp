#include "checkpoint/file_io.h"

#include <dirent.h>
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include <c10/util/Exception.h>
#include <caffe2/serialize/inline_container.h>
#include <torch/csrc/jit/serialization/export.h>
#include <torch/csrc/jit/serialization/pickler.h>

#include <zlib.h>

#include "checkpoint/failure_injection.h"
#include "common/check.h"

namespace fsdp_muon::checkpoint {
namespace {

std::string errno_text() { return std::strerror(errno); }

void write_all(int fd, const char* data, size_t size, const std::string& path) {
  while (size > 0) {
    const ssize_t n = ::write(fd, data, size);
    if (n < 0 && errno == EINTR) continue;
    FSDP_MUON_CHECK(n > 0, "writing ", path, " failed: ", errno_text());
    data += n;
    size -= static_cast<size_t>(n);
  }
}

}  // namespace

std::string join_path(const std::string& dir, const std::string& name) {
  if (dir.empty()) return name;
  return dir.back() == '/' ? dir + name : dir + "/" + name;
}

bool path_exists(const std::string& path) {
  struct stat st {};
  return ::stat(path.c_str(), &st) == 0;
}

bool is_directory(const std::string& path) {
  struct stat st {};
  return ::stat(path.c_str(), &st) == 0 && S_ISDIR(st.st_mode);
}

bool make_directory(const std::string& path) {
  if (::mkdir(path.c_str(), 0755) == 0) return true;
  FSDP_MUON_CHECK(errno == EEXIST, "cannot create ", path, ": ", errno_text());
  FSDP_MUON_CHECK(is_directory(path), path, " exists and is not a folder");
  return false;
}

void make_directories(const std::string& path) {
  for (size_t pos = path.find('/', 1); pos != std::string::npos; pos = path.find('/', pos + 1)) {
    const std::string prefix = path.substr(0, pos);
    if (!is_directory(prefix)) make_directory(prefix);
  }
  if (!path.empty() && !is_directory(path)) make_directory(path);
}

std::vector<std::string> list_directory(const std::string& path) {
  std::vector<std::string> names;
  DIR* dir = ::opendir(path.c_str());
  if (dir == nullptr) return names;
  while (const dirent* entry = ::readdir(dir)) {
    const std::string name = entry->d_name;
    if (name != "." && name != "..") names.push_back(name);
  }
  ::closedir(dir);
  return names;
}

void remove_tree(const std::string& path) {
  struct stat st {};
  if (::lstat(path.c_str(), &st) != 0) return;
  if (S_ISDIR(st.st_mode)) {
    for (const std::string& name : list_directory(path)) remove_tree(join_path(path, name));
    ::rmdir(path.c_str());
  } else {
    ::unlink(path.c_str());
  }
}

void write_file_atomic(const std::string& path, const std::vector<Chunk>& chunks) {
  const auto slash = path.rfind('/');
  const std::string dir = slash == std::string::npos ? std::string(".")
                          : slash == 0               ? std::string("/")
                                                     : path.substr(0, slash);
  const std::string tmp = path + ".tmp." + std::to_string(::getpid());
  const InjectedFailure fail = take_injected_failure();
  int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  FSDP_MUON_CHECK(fd >= 0, "cannot create ", tmp, ": ", errno_text());
  try {
    size_t total = 0;
    for (const Chunk& c : chunks) total += c.size;
    size_t budget = fail != InjectedFailure::kNone ? total / 2 : total;
    for (const Chunk& c : chunks) {
      const size_t n = std::min(budget, c.size);
      write_all(fd, static_cast<const char*>(c.data), n, tmp);
      budget -= n;
    }
    FSDP_MUON_CHECK(fail != InjectedFailure::kCrash, "injected failure while writing ", path, " (",
                    total / 2, " of ", total, " bytes written to ", tmp, ")");
    FSDP_MUON_CHECK(fail != InjectedFailure::kWriteError, "injected write error while writing ",
                    path, " (as when the disk is full: ", total / 2, " of ", total,
                    " bytes written to ", tmp, ")");
    FSDP_MUON_CHECK(::fsync(fd) == 0, "fsync of ", tmp, " failed: ", errno_text());
    const int closed = ::close(fd);
    fd = -1;
    FSDP_MUON_CHECK(closed == 0, "closing ", tmp, " failed: ", errno_text());
  } catch (...) {
    if (fd >= 0) ::close(fd);
    // A crash would leave the temporary file; an error must not, or a full disk stays full.
    if (fail != InjectedFailure::kCrash) ::unlink(tmp.c_str());
    throw;
  }
  if (::rename(tmp.c_str(), path.c_str()) != 0) {
    const std::string err = errno_text();
    ::unlink(tmp.c_str());
    FSDP_MUON_CHECK(false, "renaming ", tmp, " to ", path, " failed: ", err);
  }
  sync_folder(dir);
}

void sync_folder(const std::string& dir) {
  const int fd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  FSDP_MUON_CHECK(fd >= 0, "cannot open folder ", dir, " to fsync it: ", errno_text());
  int rc = ::fsync(fd);
  if (take_injected_folder_sync_failure()) {
    rc = -1;
    errno = EIO;
  }
  const int err = errno;
  ::close(fd);
  // EINVAL: this file system cannot sync folders at all (the rename is still atomic); anything
  // else (EIO above all) means the new name may not survive a crash, so the save fails.
  FSDP_MUON_CHECK(rc == 0 || err == EINVAL, "fsync of folder ", dir,
                  " failed: ", std::strerror(err));
}

std::vector<char> pickle_save_plain(const c10::IValue& value) {
  std::vector<char> pickle_data;
  torch::jit::Pickler pickler(
      [&](const char* buf, size_t size) { pickle_data.insert(pickle_data.end(), buf, buf + size); },
      /*tensor_table=*/nullptr, /*type_renamer=*/nullptr, /*memoized_class_types=*/nullptr,
      /*get_tensor_id=*/nullptr, /*tag_aggregates=*/false);
  pickler.protocol();
  pickler.pushIValue(value);
  pickler.stop();
  std::vector<char> container;
  caffe2::serialize::PyTorchStreamWriter writer([&](const void* data, size_t size) {
    const char* p = static_cast<const char*>(data);
    container.insert(container.end(), p, p + size);
    return size;
  });
  torch::jit::writeArchiveAndTensors("data", pickle_data.data(), pickle_data.size(),
                                     pickler.tensorData(), writer);
  writer.writeEndOfFile();
  return container;
}

// zlib's CRC-32 (the ISO-HDLC polynomial our files have always used, reflected 0xEDB88320), so
// checkpoints written by the hand-written table before it read back unchanged.
uint32_t crc32(const void* data, size_t size, uint32_t crc) {
  return static_cast<uint32_t>(
      ::crc32_z(crc, static_cast<const Bytef*>(data), static_cast<z_size_t>(size)));
}

std::vector<char> read_whole_file(const std::string& path) {
  ReadFile file(path);
  std::vector<char> bytes(static_cast<size_t>(file.size()));
  if (!bytes.empty()) file.read(0, bytes.data(), bytes.size());
  return bytes;
}

ReadFile::ReadFile(const std::string& path) : path_(path) {
  fd_ = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  FSDP_MUON_CHECK(fd_ >= 0, "cannot open ", path, ": ", errno_text());
  struct stat st {};
  if (::fstat(fd_, &st) != 0) {
    const std::string err = errno_text();
    ::close(fd_);
    fd_ = -1;
    FSDP_MUON_CHECK(false, "cannot stat ", path, ": ", err);
  }
  if (!S_ISREG(st.st_mode)) {
    ::close(fd_);
    fd_ = -1;
    FSDP_MUON_CHECK(false, path, " is ", S_ISDIR(st.st_mode) ? "a folder" : "not a file",
                    " where a checkpoint file should be");
  }
  size_ = static_cast<int64_t>(st.st_size);
}

ReadFile::~ReadFile() {
  if (fd_ >= 0) ::close(fd_);
}

ReadFile::ReadFile(ReadFile&& other) noexcept
    : path_(std::move(other.path_)), fd_(other.fd_), size_(other.size_) {
  other.fd_ = -1;
}

ReadFile& ReadFile::operator=(ReadFile&& other) noexcept {
  if (this != &other) {
    if (fd_ >= 0) ::close(fd_);
    path_ = std::move(other.path_);
    fd_ = other.fd_;
    size_ = other.size_;
    other.fd_ = -1;
  }
  return *this;
}

void ReadFile::read(int64_t offset, void* out, size_t size) const {
  FSDP_MUON_CHECK(offset >= 0 && offset + static_cast<int64_t>(size) <= size_, path_,
                  " is truncated: reading bytes [", offset, ", ",
                  offset + static_cast<int64_t>(size), ") but the file has ", size_, " bytes");
  char* dst = static_cast<char*>(out);
  while (size > 0) {
    const ssize_t n = ::pread(fd_, dst, size, static_cast<off_t>(offset));
    if (n < 0 && errno == EINTR) continue;
    FSDP_MUON_CHECK(n >= 0, "reading ", path_, " failed: ", errno_text());
    FSDP_MUON_CHECK(n > 0, path_, " is truncated: it ends at byte ", offset);
    dst += n;
    offset += n;
    size -= static_cast<size_t>(n);
  }
}

}  // namespace fsdp_muon::checkpoint
