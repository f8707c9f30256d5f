# The layer check of cmake/GemstageLayers.cmake can fail: each case below is a two-room project
# laid out as gemstage is (src/low, then src/high above it), configured with that module. The
# well-layered one must configure; a lower room including an upper room's header, and a room
# naming a dependency declared after it (a cycle), must fail with the module's message.
#   cmake -DGEMSTAGE_SOURCE=<repository> -DWORK=<scratch dir> -DGENERATOR=<generator>
#         -P tests/layers/check_layers.cmake
foreach(var GEMSTAGE_SOURCE WORK GENERATOR)
  if(NOT DEFINED ${var})
    message(FATAL_ERROR "check_layers.cmake: pass -D${var}=...")
  endif()
endforeach()

# Writes the case's project under WORK/NAME: low.cc's text, and the DEPS of low.
function(write_case name low_cc low_deps)
  set(dir ${WORK}/${name})
  file(REMOVE_RECURSE ${dir})
  file(WRITE ${dir}/CMakeLists.txt
       "cmake_minimum_required(VERSION 3.25)\n"
       "project(layers_${name} LANGUAGES CXX)\n"
       "include(${GEMSTAGE_SOURCE}/cmake/GemstageLayers.cmake)\n"
       "add_subdirectory(src/low)\n"
       "add_subdirectory(src/high)\n"
       "gemstage_check_layers()\n")
  file(WRITE ${dir}/src/low/CMakeLists.txt "gemstage_layer(low SOURCES low.cc ${low_deps})\n")
  file(WRITE ${dir}/src/low/low.h "#pragma once\nint low_value();\n")
  file(WRITE ${dir}/src/low/low.cc "${low_cc}")
  file(WRITE ${dir}/src/high/CMakeLists.txt "gemstage_layer(high SOURCES high.cc DEPS low)\n")
  file(WRITE ${dir}/src/high/high.h "#pragma once\nint high_value();\n")
  file(WRITE ${dir}/src/high/high.cc
       "#include \"high/high.h\"\n#include \"low/low.h\"\nint high_value() { return low_value() + 1; }\n")
endfunction()

# Configures the case; `expect` is "" (must succeed) or text the failure must print.
function(expect_configure name expect)
  execute_process(COMMAND ${CMAKE_COMMAND} -S ${WORK}/${name} -B ${WORK}/${name}/build
                          -G ${GENERATOR}
                  RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err)
  string(REPLACE "\n" " " text "${out} ${err}")
  string(REGEX REPLACE " +" " " text "${text}")
  if(expect STREQUAL "")
    if(NOT rc EQUAL 0)
      message(FATAL_ERROR "${name}: the well-layered project did not configure:\n${out}\n${err}")
    endif()
  elseif(rc EQUAL 0)
    message(FATAL_ERROR "${name}: configured, but the layer check should have refused it")
  else()
    string(FIND "${text}" "${expect}" at)
    if(at EQUAL -1)
      message(FATAL_ERROR "${name}: failed without the expected message '${expect}':\n${err}")
    endif()
  endif()
  message(STATUS "${name}: as expected")
endfunction()

set(plain_low "#include \"low/low.h\"\nint low_value() { return 1; }\n")
write_case(well_layered "${plain_low}" "")
expect_configure(well_layered "")

write_case(upward_include "#include \"low/low.h\"\n#include \"high/high.h\"\nint low_value() { return 1; }\n" "")
expect_configure(upward_include
                 "src/low/low.cc includes high/, but src/low depends only on:")

write_case(dependency_cycle "${plain_low}" "DEPS high")
expect_configure(dependency_cycle
                 "src/low depends on 'high', which is not a room declared before it")
