# The source folders are libraries stacked in one direction. gemstage_layer(ROOM DEPS ...) makes
# src/ROOM the static library gemstage_ROOM, linked to the rooms it names; a room may only name
# rooms declared before it, so the graph has no cycle. gemstage_check_layers() then reads every
# source's #include "room/..." lines and fails the configure step when a file includes a room its
# own room does not depend on (directly or through its dependencies): a new include cycle, or a
# shortcut around the layering, is a build error rather than a review comment.

set(GEMSTAGE_LAYERS "" CACHE INTERNAL "")

function(gemstage_layer room)
  cmake_parse_arguments(ARG "" "" "SOURCES;DEPS;LINK" ${ARGN})
  set(closure ${ARG_DEPS})
  foreach(dep IN LISTS ARG_DEPS)
    if(NOT dep IN_LIST GEMSTAGE_LAYERS)
      message(FATAL_ERROR "src/${room} depends on '${dep}', which is not a room declared before it "
                          "(declared so far: ${GEMSTAGE_LAYERS}); rooms depend only downwards")
    endif()
    list(APPEND closure ${GEMSTAGE_LAYER_CLOSURE_${dep}})
  endforeach()
  list(REMOVE_DUPLICATES closure)
  set(GEMSTAGE_LAYER_CLOSURE_${room} "${closure}" CACHE INTERNAL "")
  set(GEMSTAGE_LAYERS "${GEMSTAGE_LAYERS};${room}" CACHE INTERNAL "")

  add_library(gemstage_${room} STATIC ${ARG_SOURCES})
  target_include_directories(gemstage_${room} PUBLIC ${PROJECT_SOURCE_DIR}/src)
  target_compile_options(gemstage_${room} PRIVATE ${GEMSTAGE_WARNINGS})
  foreach(dep IN LISTS ARG_DEPS)
    target_link_libraries(gemstage_${room} PUBLIC gemstage_${dep})
  endforeach()
  if(ARG_LINK)
    target_link_libraries(gemstage_${room} PUBLIC ${ARG_LINK})
  endif()
endfunction()

function(gemstage_check_layers)
  set(errors "")
  foreach(room IN LISTS GEMSTAGE_LAYERS)
    if(room STREQUAL "")
      continue()
    endif()
    file(GLOB_RECURSE files ${PROJECT_SOURCE_DIR}/src/${room}/*.h ${PROJECT_SOURCE_DIR}/src/${room}/*.cc)
    foreach(f IN LISTS files)
      file(STRINGS ${f} lines REGEX "^#include \"[a-z0-9_]+/")
      foreach(line IN LISTS lines)
        string(REGEX REPLACE "^#include \"([a-z0-9_]+)/.*" "\\1" target "${line}")
        if(NOT target STREQUAL room AND NOT target IN_LIST GEMSTAGE_LAYER_CLOSURE_${room})
          file(RELATIVE_PATH rel ${PROJECT_SOURCE_DIR} ${f})
          string(APPEND errors "\n  ${rel} includes ${target}/, but src/${room} depends only on: "
                               "${GEMSTAGE_LAYER_CLOSURE_${room}}")
        endif()
      endforeach()
    endforeach()
  endforeach()
  if(errors)
    message(FATAL_ERROR "include outside the declared layering (cmake/GemstageLayers.cmake):"
                        "${errors}")
  endif()
endfunction()
