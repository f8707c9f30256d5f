# GEMSTAGE_KERNELS_ONLY: the rooms below the model code (core, cache, kernels) and their tests
# (tests/kernels_test.cc, tests/quant_test.cc) as one GoogleTest binary, gemstage_kernel_tests.
# This is what the `aarch64` preset cross-builds: it needs no third-party library but GoogleTest,
# which is compiled here from Debian's sources (package googletest, /usr/src/googletest) for the
# target, since Debian ships no arm64 build of it to a cross toolchain. Included from the root
# CMakeLists after GEMSTAGE_WARNINGS is set.
set(GEMSTAGE_ROOMS core cache kernels)
foreach(room IN LISTS GEMSTAGE_ROOMS)
  add_subdirectory(src/${room})
endforeach()
gemstage_check_layers()

if(GEMSTAGE_BUILD_TESTS)
  set(GEMSTAGE_GTEST_SOURCE /usr/src/googletest/googletest CACHE PATH "GoogleTest sources")
  if(NOT EXISTS ${GEMSTAGE_GTEST_SOURCE}/CMakeLists.txt)
    message(FATAL_ERROR "GEMSTAGE_KERNELS_ONLY builds GoogleTest from source and found none at "
                        "${GEMSTAGE_GTEST_SOURCE}: install Debian's googletest package "
                        "(scripts/setup.sh) or set GEMSTAGE_GTEST_SOURCE")
  endif()
  set(INSTALL_GTEST OFF CACHE BOOL "" FORCE)
  add_subdirectory(${GEMSTAGE_GTEST_SOURCE} ${CMAKE_BINARY_DIR}/googletest EXCLUDE_FROM_ALL)
  enable_testing()
  add_executable(gemstage_kernel_tests tests/kernels_test.cc tests/quant_test.cc)
  target_compile_options(gemstage_kernel_tests PRIVATE ${GEMSTAGE_WARNINGS})
  target_link_libraries(gemstage_kernel_tests PRIVATE gemstage_kernels gtest gtest_main)
  set_target_properties(gemstage_kernel_tests PROPERTIES RUNTIME_OUTPUT_DIRECTORY
                                                         ${CMAKE_BINARY_DIR}/tests)
  # One ctest entry for the whole binary (under the cross toolchain's emulator, qemu-aarch64):
  # listing each test case through qemu would cost a start-up per case.
  add_test(NAME kernel_tests COMMAND gemstage_kernel_tests)
  set_tests_properties(kernel_tests PROPERTIES TIMEOUT 600)
endif()
