//! cgroup/getpeername4 and cgroup/getpeername6: a socket socklb redirected
//! shows the application the VIP it asked for, as long as its peer is
//! still the backend it was sent to. One table lookup by cookie; a socket
//! the table could not hold shows its backend.

use aya_ebpf::{macros::cgroup_sock_addr, programs::SockAddrContext};
use lb_common::{Endpoint, port_from_user_port, user_port_from_port};

use crate::{
    V4_MAPPED_WORD_BE,
    connect::{sock_addr, user_ip6},
    records,
};

const PROCEED: i32 = 1;

#[cgroup_sock_addr(getpeername4)]
pub fn socklb_getpeername4(ctx: SockAddrContext) -> i32 {
    getpeername4(&ctx);
    PROCEED
}

#[cgroup_sock_addr(getpeername6)]
pub fn socklb_getpeername6(ctx: SockAddrContext) -> i32 {
    getpeername6(&ctx);
    PROCEED
}

fn getpeername4(ctx: &SockAddrContext) {
    let sa = sock_addr(ctx);
    let peer = unsafe { Endpoint::v4((*sa).user_ip4, port_from_user_port((*sa).user_port)) };
    if let Some(vip) = records::vip_for_peer(ctx, &peer) {
        unsafe {
            (*sa).user_ip4 = vip.addr_be[0];
            (*sa).user_port = user_port_from_port(vip.port_be);
        }
    }
}

fn getpeername6(ctx: &SockAddrContext) {
    let sa = sock_addr(ctx);
    let words = user_ip6(sa);
    let port_be = unsafe { port_from_user_port((*sa).user_port) };
    let mapped = words[0] == 0 && words[1] == 0 && words[2] == V4_MAPPED_WORD_BE;
    let peer = if mapped {
        Endpoint::v4(words[3], port_be)
    } else {
        Endpoint::v6(words, port_be)
    };
    let Some(vip) = records::vip_for_peer(ctx, &peer) else {
        return;
    };
    unsafe {
        if mapped {
            (*sa).user_ip6[3] = vip.addr_be[0];
        } else {
            (*sa).user_ip6[0] = vip.addr_be[0];
            (*sa).user_ip6[1] = vip.addr_be[1];
            (*sa).user_ip6[2] = vip.addr_be[2];
            (*sa).user_ip6[3] = vip.addr_be[3];
        }
        (*sa).user_port = user_port_from_port(vip.port_be);
    }
}
