// Hand-written CANN behaviour needed by torchair's C extensions on the
// compile / codegen path (everything else is an auto-generated "return 0"
// stub, see gen_stubs.py).
//
// Built with -D_GLIBCXX_USE_CXX11_ABI=0: the GE / metadef APIs that the
// torch_npu wheel links against use the pre-C++11 std::string ABI.
//
// The class layouts below are our own minimal guesses that are compatible
// with the way the wheel's code *uses* these types (by value / by reference,
// never touching private members); they were written from the mangled symbol
// names that the extensions import, not from CANN headers.
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <iostream>
#include <map>
#include <memory>
#include <string>

namespace {
bool StubVerbose() { return std::getenv("CANN_STUB_QUIET") == nullptr; }
}  // namespace

namespace ge {
using Status = uint32_t;

// A single shared_ptr member: same size as the real class, and enough for
// std::map<AscendString, AscendString> option maps to work.
class AscendString {
 public:
  AscendString() = default;
  AscendString(const char *name);
  AscendString(const char *name, size_t length);
  const char *GetString() const;
  size_t GetLength() const;
  bool operator<(const AscendString &other) const;
  bool operator==(const AscendString &other) const;

 private:
  std::shared_ptr<std::string> text_;
};

AscendString::AscendString(const char *name) {
  if (name) text_ = std::make_shared<std::string>(name);
}

AscendString::AscendString(const char *name, size_t length) {
  if (name) text_ = std::make_shared<std::string>(name, length);
}

const char *AscendString::GetString() const { return text_ ? text_->c_str() : ""; }

size_t AscendString::GetLength() const { return text_ ? text_->size() : 0; }

bool AscendString::operator<(const AscendString &other) const {
  return std::strcmp(GetString(), other.GetString()) < 0;
}

bool AscendString::operator==(const AscendString &other) const {
  return std::strcmp(GetString(), other.GetString()) == 0;
}

Status GEInitialize(const std::map<AscendString, AscendString> &options) {
  if (StubVerbose()) {
    std::cerr << "[cann-stub] GEInitialize with " << options.size() << " option(s):";
    for (const auto &kv : options) std::cerr << ' ' << kv.first.GetString() << '=' << kv.second.GetString();
    std::cerr << std::endl;
  }
  return 0;
}

Status GEFinalize() { return 0; }

std::string GEGetErrorMsg() { return "[cann-stub] CANN is stubbed, no GE error message available"; }

AscendString GEGetWarningMsgV2() { return AscendString(""); }
}  // namespace ge

extern "C" const char *aclrtGetSocName() {
  const char *soc = std::getenv("CANN_STUB_SOC_NAME");
  return soc ? soc : "Ascend910B1";
}
